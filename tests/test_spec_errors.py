"""Golden error tests: each case is one distinct mistake; the first error it raises must
have exactly this location, message and hint. The table was written from the checker's
output and each entry reviewed by hand; a change to a message is a change to this file."""
from __future__ import annotations

import re

import pytest

from restopo.spec import SpecError, SpecErrors, parse_spec

M = "model { vocab: 256; width: 64; depth: 4; heads: 4; context: 64 }\n"

# (name, spec text, overrides, path, line, column, message, hint)
GOLDEN = [
    ('syntax_equals', M.replace("vocab: 256", "vocab = 256") + "residual standard\n", (),
     'spec.restopo', 1, 15,
     "unexpected '='",
     "write 'key: value' (with a colon) or, on the command line, --set section.key=value"),
    ('syntax_unclosed_brace', "model { vocab: 256; width: 64\nresidual standard\n", (),
     'spec.restopo', 1, 7,
     "this '{' is never closed",
     "add '}' to close it"),
    ('syntax_unclosed_paren', M + "residual block_attnres(blocks: 2\n", (),
     'spec.restopo', 2, 23,
     "this '(' is never closed",
     "add ')' to close it"),
    ('syntax_unclosed_brace_before_a_section',  # was "unexpected '{'" at train's brace
     "model { vocab: 256; width: 64\nresidual standard\ntrain { steps: 3 }\n", (),
     'spec.restopo', 1, 7,
     "this '{' is never closed",
     "add '}' where it should end: before line 3 at the latest, where 'train { steps: 3 }' "
     "opens another"),
    ('syntax_unclosed_paren_before_a_section',
     M + "residual block_attnres(blocks: 2\ntrain { steps: 3 }\n", (),
     'spec.restopo', 2, 23,
     "this '(' is never closed",
     "add ')' where it should end: before line 3 at the latest, where 'train { steps: 3 }' "
     "opens another"),
    ('residual_without_topology',  # was 'custom wiring needs a rule' and a line per key
     M + "residual\ntrain { steps: 3; lr: 1e-3 }\n", (),
     'spec.restopo', 2, 1,
     "'residual' needs a topology; here the train section that follows was read as one",
     "write e.g. 'residual standard', 'residual block_attnres(blocks: 8)' or 'residual custom "
     "{ before sublayer: ... }'"),
    ('syntax_colon_after_section', M + "residual: standard\n", (),
     'spec.restopo', 2, 9,
     "unexpected ':'",
     "a section has no ':' after its name: write 'residual standard'"),
    ('syntax_colon_after_section_rewritten',  # was the same three examples as above
     M + 'residual standard\ntrain: { data: "a#b.txt"; steps: 3 }  # quick\n', (),
     'spec.restopo', 3, 6,
     "unexpected ':'",
     "a section has no ':' after its name: write 'train { data: \"a#b.txt\"; steps: 3 }'"),
    ('syntax_missing_value', M + "residual standard\ntrain { steps: }\n", (),
     'spec.restopo', 3, 16,
     "unexpected '}'",
     'a value is missing after \':\'; expected a name, a number or a "quoted string"'),
    ('syntax_section_without_braces', M + "residual standard\ntrain steps: 3\n", (),
     'spec.restopo', 3, 14,
     "unexpected number '3'",
     "the train section's entries go in braces, e.g. 'train { steps: 3 }'"),
    ('syntax_bad_character', M + "residual standard @\n", (),
     'spec.restopo', 2, 19,
     "unexpected character '@'",
     "expected a name, '{', '(', ':' or ';'"),
    ('syntax_unquoted_path', M + "residual standard\ntrain { data: corpus.txt }\n", (),
     'spec.restopo', 3, 21,
     "unexpected character '.'",
     'paths are quoted: write "corpus.txt"'),
    ('syntax_escaped_quote',  # was: this '"' is never closed; end the string with " ...
     M + 'residual standard\ntrain { data: "a\\"b" }\n', (),
     'spec.restopo', 3, 20,
     "unexpected character '\"'",
     'strings have no escapes, so "a\\" ended at its \\"; a string cannot hold a \'"\''),
    ('syntax_escaped_quote_then_a_path',  # was: paths are quoted: write "b.txt"
     M + 'residual standard\ntrain { data: "a\\"b.txt" }\n', (),
     'spec.restopo', 3, 20,
     "unexpected character '.'",
     'strings have no escapes, so "a\\" ended at its \\"; a string cannot hold a \'"\''),
    ('syntax_stray_close', M + "residual standard\n}\n", (),
     'spec.restopo', 3, 1,
     "unexpected '}': nothing is open here",
     "remove it, or check the opening '{' above"),
    ('unknown_section', M + "residual standard\ntraining { steps: 10 }\n", (),
     'spec.restopo', 3, 1,
     "unknown section 'training'",
     "sections are model, residual, parallel and train; did you mean 'train'?"),
    ('duplicate_section', M + "residual standard\nresidual full_attnres\n", (),
     'spec.restopo', 3, 1,
     "duplicate section 'residual' (first given at line 2)",
     'each section may appear once; merge them or remove one'),
    ('missing_residual', M, (),
     'spec.restopo', 1, 1,
     'the spec has no residual section',
     "add a line such as 'residual block_attnres(blocks: 8)' or 'residual standard'"),
    ('empty_spec', "# nothing here\n", (),
     'spec.restopo', 1, 1,
     'the spec is empty',
     "add a line such as 'residual block_attnres(blocks: 8)' or 'residual standard'"),
    ('model_without_braces', "model tiny\nresidual standard\n", (),
     'spec.restopo', 1, 7,
     'the model section needs braces: model { key: value ... }',
     'e.g. model { width: 64 }'),
    ('unknown_model_key', M.replace("width: 64", "widht: 64") + "residual standard\n", (),
     'spec.restopo', 1, 21,
     "unknown key 'widht' in model",
     "did you mean 'width'?"),
    ('duplicate_key', M.replace("depth: 4", "depth: 4; depth: 6") + "residual standard\n", (),
     'spec.restopo', 1, 42,
     "duplicate key 'depth' in model (first given at line 1)",
     'remove one of them'),
    ('missing_model_key', M.replace("; context: 64", "") + "residual standard\n", (),
     'spec.restopo', 1, 1,
     "the model section is missing 'context'",
     "add 'context: 64'"),
    # a bound with no reason of its own was shown with no hint line at all
    ('mlp_ratio_zero_has_hint', M.replace("context: 64", "context: 64; mlp: swiglu(0x)")
     + "residual standard\n", (),
     'spec.restopo', 1, 77,
     "'mlp ratio' must be greater than 0, got 0x",
     'e.g. swiglu(4x)'),
    # '4_' and '6__4' read as 4 and 64 without a word: '_' may only separate digits
    ('misplaced_underscore_in_number', M.replace("depth: 4", "depth: 4_")
     + "residual standard\n", (),
     'spec.restopo', 1, 39,
     "misplaced '_' in '4_'",
     "'_' may only separate digits, as in 32_768; write 4"),
    ('heads_divide_width', M.replace("heads: 4", "heads: 5") + "residual standard\n", (),
     'spec.restopo', 1, 49,
     'heads (5) must divide width (64)',
     'heads that divide 64 with an even head size: 2, 4, 8'),
    # the hint named 64 (head size 1) and 2 or 6 for width 6 (head size 3 or 1): each one
    # then refused by the rotary rule; it names only heads the check accepts
    ('heads_hint_names_only_accepted_heads', M.replace("heads: 4", "heads: 63")
     + "residual standard\n", (),
     'spec.restopo', 1, 49,
     'heads (63) must divide width (64)',
     'heads that divide 64 with an even head size: 8, 16, 32'),
    ('odd_head_size', M.replace("width: 64", "width: 96").replace("heads: 4", "heads: 32")
     + "residual standard\n", (),
     'spec.restopo', 1, 49,
     'the head size width/heads = 3 is odd; rotary positions rotate channel pairs, so it must be even',
     'heads giving an even head size: 16, 24, 48'),
    ('odd_width_no_heads', M.replace("width: 64", "width: 9").replace("heads: 4", "heads: 1")
     + "residual standard\n", (),
     'spec.restopo', 1, 48,
     'the head size width/heads = 9 is odd; rotary positions rotate channel pairs, so it must be even',
     'no heads do for an odd width (9); make the width even'),
    ('mlp_no_hidden_units', M.replace("context: 64", "context: 64; mlp: gelu(0.001x)")
     + "residual standard\n", (),
     'spec.restopo', 1, 75,
     "the MLP's hidden width, ratio x width = 0.001 x 64, rounds to 0 units",
     'give a ratio of at least 0.0156x, e.g. gelu(4x)'),
    ('depth_zero', M.replace("depth: 4", "depth: 0") + "residual standard\n", (),
     'spec.restopo', 1, 39,
     "'depth' must be at least 1, got 0",
     'depth counts transformer layers'),
    ('vocab_one', M.replace("vocab: 256", "vocab: 1") + "residual standard\n", (),
     'spec.restopo', 1, 16,
     "'vocab' must be at least 2, got 1",
     'the vocabulary needs at least 2 tokens'),
    ('not_whole_number', M.replace("width: 64", "width: 64.5") + "residual standard\n", (),
     'spec.restopo', 1, 28,
     "'width' must be a whole number, got 64.5",
     'e.g. width: 64'),
    ('ratio_unit_on_count', M.replace("width: 64", "width: 64x") + "residual standard\n", (),
     'spec.restopo', 1, 28,
     "'width' is not a ratio; write 64 without 'x'",
     "the 'x' unit marks a ratio, as in mlp: swiglu(4x)"),
    ('section_label_not_a_name',  # was "unexpected '{'" after it, expecting a key
     M.replace("model {", "model 3 {") + "residual standard\n", (),
     'spec.restopo', 1, 7,
     "a section's label is a name, got '3'",
     "e.g. 'model tiny { ... }', or no label: 'model { ... }'"),
    ('section_label_quoted', M + "residual standard\ntrain \"run\" { steps: 3 }\n", (),
     'spec.restopo', 3, 7,
     "a section's label is a name, got '\"run\"'",
     "e.g. 'train tiny { ... }', or no label: 'train { ... }'"),
    ('set_with_a_line_break',  # was at line 2 of a '--set' shown over two lines
     M + "residual standard\n", ("model.width=32\nmodel.depth=3",),
     '<--set 1>', 1, 21,
     "a line break in --set",
     "give each setting its own --set, e.g. --set model.width=64 --set model.depth=4"),
    ('ratio_unit_on_a_rate',  # was "write 0.003 without 'x'": the number rewritten
     M + "residual standard\ntrain { lr: 3e-3x }\n", (),
     'spec.restopo', 3, 13,
     "'lr' is not a ratio; write 3e-3 without 'x'",
     "the 'x' unit marks a ratio, as in mlp: swiglu(4x)"),
    ('unknown_unit', M.replace("vocab: 256", "vocab: 256q") + "residual standard\n", (),
     'spec.restopo', 1, 16,
     "unknown unit 'q' in '256q'",
     'units: x (a ratio), k (thousand), M (million); e.g. 4x, 32k, 3e-3'),
    ('unknown_mlp', M.replace("context: 64", "context: 64; mlp: swigul(4x)") + "residual standard\n", (),
     'spec.restopo', 1, 70,
     "unknown MLP kind 'swigul'",
     "did you mean 'swiglu'?"),
    ('layer_starts_with_mlp', M.replace("context: 64", "context: 64\n layer: mlp attn") + "residual standard\n", (),
     'spec.restopo', 2, 9,
     "a transformer layer must begin with 'attn'",
     'block boundaries fall before attention sublayers; e.g. layer: attn mlp'),
    ('unknown_sublayer_kind', M.replace("context: 64", "context: 64\n layer: attn moe") + "residual standard\n", (),
     'spec.restopo', 2, 14,
     "unknown sublayer kind 'moe'",
     'expected one of: attn, mlp'),
    ('bad_boolean', M.replace("context: 64", "context: 64; tie_embeddings: yes") + "residual standard\n", (),
     'spec.restopo', 1, 81,
     "unknown tie_embeddings 'yes'",
     'expected one of: true, false'),
    ('list_where_one_value', M.replace("context: 64", "context: 64 128") + "residual standard\n", (),
     'spec.restopo', 1, 64,
     "'context' takes one value, got 2 (64 128)",
     "remove the extra values; put each entry on its own line or separate entries with ';'"),
    ('two_word_key', M.replace("context: 64", "context: 64\n mlp ratio: 4") + "residual standard\n",
     (), 'spec.restopo', 2, 2,
     "unexpected 'mlp ratio:' in model",
     "keys are one word: write 'mlp_ratio:'"),
    ('rule_with_another_word', M + "residual custom {\n before sublayer: sum(embedding, sublayers)"
     "\n after head: sum(embedding)\n}\n", (), 'spec.restopo', 4, 2,
     "unknown rule 'after head:'",
     "rules are 'before sublayer:' (every sublayer) and 'before head:'"),
    ('unknown_topology', M + "residual block_atnres(blocks: 2)\n", (),
     'spec.restopo', 2, 10,
     "unknown topology 'block_atnres'",
     "did you mean 'block_attnres'?"),
    ('unknown_option', M + "residual block_attnres(blocks: 2, qeury: static)\n", (),
     'spec.restopo', 2, 35,
     "unknown option 'qeury' for block_attnres",
     "did you mean 'query'?"),
    ('option_of_other_topology', M + "residual full_attnres(blocks: 2)\n", (),
     'spec.restopo', 2, 23,
     "option 'blocks' does not apply to full_attnres",
     "'blocks' is an option of block_attnres; full_attnres takes query, gate, key_norm, heads or window"),
    ('standard_takes_no_options', M + "residual standard(blocks: 2)\n", (),
     'spec.restopo', 2, 19,
     "'standard' takes no options, got 'blocks'",
     "write 'residual standard'"),
    ('blocks_not_allowed', M + "residual block_attnres(blocks: 5)\n", (),
     'spec.restopo', 2, 32,
     'blocks must be between 1 and 4 (the number of transformer layers), or 8 (one block per sublayer, Full AttnRes); got 5',
     'for depth 4 (8 sublayers) blocks may be 1, 2, 3, 4 or 8; 8 gives one block per sublayer (Full AttnRes)'),
    ('block_size_not_multiple', M + "residual block_attnres(block_size: 3)\n", (),
     'spec.restopo', 2, 36,
     'block_size 3 would begin a block at sublayer 4, an mlp; blocks must begin at an attention sublayer (block_size counts sublayers)',
     'for these 8 sublayers block_size may be 1, 2, 4, 6 or 8'),
    ('block_size_two_attentions_a_layer',
     M.replace("context: 64", "context: 64; layer: attn attn mlp")
     + "residual block_attnres(block_size: 2)\n", (),
     'spec.restopo', 2, 36,
     'block_size 2 would begin a block at sublayer 3, an mlp; blocks must begin at an attention sublayer (block_size counts sublayers)',
     'for these 12 sublayers block_size may be 1, 3, 6, 7, 9, 10 or 12'),
    ('blocks_and_block_size', M + "residual block_attnres(blocks: 2, block_size: 4)\n", (),
     'spec.restopo', 2, 35,
     "give either 'blocks' or 'block_size', not both",
     'blocks: N cuts the model into N blocks; block_size: S makes blocks of S sublayers'),
    ('block_attnres_needs_blocks', M + "residual block_attnres\n", (),
     'spec.restopo', 2, 10,
     "block_attnres needs 'blocks: N' or 'block_size: S'",
     'for depth 4 (8 sublayers) blocks may be 1, 2, 3, 4 or 8; 8 gives one block per sublayer (Full AttnRes)'),
    ('window_below_one', M + "residual full_attnres(window: 0)\n", (),
     'spec.restopo', 2, 31,
     "'window' must be at least 1, got 0",
     'the window counts earlier sublayer outputs'),
    ('unknown_gate', M + "residual full_attnres(gate: tanh)\n", (),
     'spec.restopo', 2, 29,
     "unknown gate 'tanh'",
     'expected one of: softmax, sigmoid'),
    ('depth_heads_divide_width', M + "residual block_attnres(blocks: 2, heads: 3)\n", (),
     'spec.restopo', 2, 42,
     'depth-attention heads (3) must divide width (64)',
     'heads that divide 64: 1, 2, 4, 8, 16, 32, 64'),
    ('positional_option', M + "residual block_attnres(2)\n", (),
     'spec.restopo', 2, 24,
     "'block_attnres' takes named options, got '2'",
     'e.g. block_attnres(blocks: 8) or block_attnres(block_size: 4)'),
    ('positional_streams',  # was first "mhc needs 'streams: n'", then this, as 2 errors
     M + "residual mhc(4)\n", (),
     'spec.restopo', 2, 14,
     "'mhc' takes named options, got '4'",
     'write mhc(streams: 4)'),
    ('mlp_ratio_without_parentheses',  # was "'mlp' takes one value", separate the entries
     M.replace(" }", "; mlp: swiglu 4x }") + "residual standard\n", (),
     'spec.restopo', 1, 77,
     "the MLP ratio goes in parentheses, got 'swiglu 4x'",
     "write mlp: swiglu(4x), or mlp: swiglu and mlp_ratio: 4x"),
    ('choice_with_options',  # was "'schedule' must be one of cosine or constant"
     M + "residual standard\ntrain { schedule: cosine(warmup: 30) }\n", (),
     'spec.restopo', 3, 19,
     "'schedule' takes no options, got 'cosine(...)'",
     "write 'schedule: cosine'; options are keys of their own: warmup: 30"),
    ('quoted_number',  # was the key's example alone: e.g. window(8)
     M + "residual custom {\n  before sublayer: attend(embedding, window(\"3\"))\n}\n", (),
     'spec.restopo', 3, 45,
     "'window' must be a number, got '\"3\"'",
     "write it without the quotes: window(3)"),
    ('rule_heads_divide_width',  # was at the rule, 3:20
     M + "residual custom {\n  before sublayer: attend(embedding, sublayers; heads: 3)\n}\n",
     (), 'spec.restopo', 3, 56,
     'depth-attention heads (3) must divide width (64)',
     'heads that divide 64: 1, 2, 4, 8, 16, 32, 64'),
    ('key_of_another_section',  # was the model's keys: expected one of vocab, width, ...
     M.replace(" }", "; steps: 300 }") + "residual standard\n", (),
     'spec.restopo', 1, 65,
     "unknown key 'steps' in model",
     "'steps' belongs in the train section: train { steps: 300 }"),
    ('residual_key_in_model', M.replace(" }", "; blocks: 2 }") + "residual standard\n", (),
     'spec.restopo', 1, 65,
     "unknown key 'blocks' in model",
     "'blocks' is an option of the residual topology, e.g. residual block_attnres(blocks: 2)"),
    ('train_key_in_a_topology', M + "residual block_attnres(blocks: 2, lr: 1e-3)\n", (),
     'spec.restopo', 2, 35,
     "unknown option 'lr' for block_attnres",
     "'lr' belongs in the train section: train { lr: 1e-3 }"),
    ('rule_in_model',
     M.replace(" }", "; before head: sum() }") + "residual standard\n",
     (), 'spec.restopo', 1, 65,
     "unexpected 'before head:' in model",
     "rules belong in custom wiring: residual custom { before head: attend(embedding, "
     "sublayers) }"),
    ('unknown_source', M + "residual custom {\n  before sublayer: attend(embedding, blcks, partial)\n}\n", (),
     'spec.restopo', 3, 38,
     "unknown source 'blcks'",
     "did you mean 'blocks'?"),
    ('source_nested_in_a_method',  # was "unknown source 'sum(...)'", listing the sources
     M + "residual custom {\n  before sublayer: attend(embedding, sum(blocks, partial))\n}\n", (),
     'spec.restopo', 3, 38,
     "sources do not nest: 'sum(...)' is an aggregation method, and a rule is one method "
     "over a list of sources",
     "list the sources in attend(...) itself, e.g. attend(embedding, blocks, partial); to "
     "read the sum of consecutive outputs, make them a block (blocks: N or block_size: S) "
     "and read 'blocks' and 'partial', as block_attnres does"),
    ('sources_without_commas',  # was "expected a source, got 'embedding sublayers'"
     M + "residual custom {\n  before sublayer: attend(embedding sublayers)\n}\n", (),
     'spec.restopo', 3, 37,
     "sources are separated by ',', got 'embedding sublayers'",
     "write attend(embedding, sublayers)"),
    ('number_with_a_unit_word',  # was "'window' takes one value, got 2", separate entries
     M + "residual custom {\n  before sublayer: attend(embedding, window(8 layers))\n}\n", (),
     'spec.restopo', 3, 47,
     "'window' takes a number alone, got '8 layers'",
     "write the number alone: window(8); it counts sublayers, 2 per transformer layer"),
    ('two_windows',  # was "source 'window(4)' is listed twice"
     M + "residual custom {\n  before sublayer: attend(embedding, window(8), window(4))\n}\n",
     (), 'spec.restopo', 3, 49,
     "a rule reads one window, got 'window(8)' and 'window(4)'",
     "keep one: the larger reads every output the smaller does"),
    ('unknown_method', M + "residual custom {\n  before sublayer: atend(embedding, blocks)\n}\n", (),
     'spec.restopo', 3, 20,
     "unknown aggregation method 'atend'",
     "did you mean 'attend'?"),
    ('option_on_wrong_method', M + "residual custom {\n  before sublayer: sum(embedding, sublayers; query: static)\n}\n", (),
     'spec.restopo', 3, 46,
     "option 'query' does not apply to sum",
     'sum takes no options (attend takes query, gate, key_norm or heads; scalars takes gate)'),
    ('reads_no_source', M + "residual custom {\n  before sublayer: attend(query: static)\n}\n", (),
     'spec.restopo', 3, 20,
     'this attend reads no source',
     'list its sources, e.g. attend(embedding, blocks, partial)'),
    ('first_sublayer_reads_nothing', M + "residual custom {\n  before sublayer: attend(blocks, partial)\n}\n", (),
     'spec.restopo', 3, 20,
     "the first sublayer would read no source: 'blocks' and 'partial' are empty before it",
     "add 'embedding', e.g. attend(embedding, ...)"),
    ('partial_before_head', M + "residual custom {\n  before sublayer: attend(embedding, blocks, partial)\n  before head: attend(embedding, blocks, partial)\n}\n", (),
     'spec.restopo', 4, 42,
     "'partial' cannot be read before the head: every block is complete there",
     "read 'blocks' (all blocks) at the head"),
    ('unknown_rule_target', M + "residual custom {\n  before sublayer: attend(embedding, blocks)\n  before attn: sum(embedding)\n}\n", (),
     'spec.restopo', 4, 3,
     "unknown rule target 'attn'",
     "rules are 'before sublayer:' (every sublayer) and 'before head:'"),
    ('missing_sublayer_rule', M + "residual custom {\n  blocks: 2\n}\n", (),
     'spec.restopo', 2, 10,
     "custom wiring needs a 'before sublayer:' rule",
     'e.g. before sublayer: attend(embedding, blocks, partial)'),
    ('duplicate_source', M + "residual custom {\n  before sublayer: attend(embedding, blocks, blocks)\n}\n", (),
     'spec.restopo', 3, 46,
     "source 'blocks' is listed twice",
     'list each source once'),
    ('window_needs_size', M + "residual custom {\n  before sublayer: attend(embedding, window)\n}\n", (),
     'spec.restopo', 3, 38,
     'window needs a size',
     'e.g. window(8): the last 8 sublayer outputs'),
    ('window_zero_custom', M + "residual custom {\n  before sublayer: attend(embedding, window(0))\n}\n", (),
     'spec.restopo', 3, 45,
     "'window' must be at least 1, got 0",
     'the window counts earlier sublayer outputs'),
    ('stream_method_sources', M + "residual custom {\n  before sublayer: rezero(embedding, blocks)\n}\n", (),
     'spec.restopo', 3, 38,
     'rezero updates one running stream and always reads the embedding and every earlier sublayer',
     'write rezero() or rezero(embedding, sublayers)'),
    ('entries_on_one_line', M.replace("context: 64", "context: 64\n layer: attn mlp tie_embeddings: true") + "residual standard\n", (),
     'spec.restopo', 2, 14,
     "unexpected 'mlp tie_embeddings:' in model",
     "put each entry on its own line or separate entries with ';'"),
    ('unknown_schedule', M + "residual standard\nparallel { pipeline(stages: 2, schedule: interleaved) }\n", (),
     'spec.restopo', 3, 42,
     "unknown schedule 'interleaved'",
     "did you mean 'interleaved_1f1b'?"),
    ('too_many_chunks', M + "residual standard\nparallel { pipeline(stages: 4, virtual: 4, microbatches: 8) }\n", (),
     'spec.restopo', 3, 41,
     'stages x virtual = 16 model chunks, but the model has only 8 sublayers',
     'each chunk needs at least one sublayer; use fewer stages or virtual stages, or a deeper model'),
    ('microbatches_below_stages', M + "residual standard\nparallel { pipeline(stages: 4, microbatches: 2) }\n", (),
     'spec.restopo', 3, 46,
     'microbatches (2) must be at least stages (4)',
     'with fewer microbatches than stages some stages would sit idle; use microbatches: 4 or more'),
    ('virtual_needs_interleaved', M + "residual standard\nparallel { pipeline(stages: 2, virtual: 2, schedule: 1f1b) }\n", (),
     'spec.restopo', 3, 54,
     'schedule 1f1b runs one chunk per stage, but virtual is 2',
     'use schedule: interleaved_1f1b (1F1B over virtual stages) or gpipe, or virtual: 1'),
    ('one_stage_with_virtual', M + "residual standard\nparallel { pipeline(stages: 1, virtual: 2) }\n", (),
     'spec.restopo', 3, 29,
     'a pipeline needs at least 2 stages; got stages: 1 with virtual: 2',
     "virtual stages interleave chunks over the pipeline's ranks; use stages: 2 or more, or leave virtual out"),
    ('unknown_parallelism', M + "residual standard\nparallel { tensor(stages: 2) }\n", (),
     'spec.restopo', 3, 12,
     "unknown parallelism 'tensor'",
     'restopo plans pipeline parallelism: pipeline(stages: 2, ...)'),
    ('parallel_missing_stages',  # was: e.g. parallel { pipeline(stages: 2, microbatches: 4)
     # } or parallel { data: fsdp }, whatever the pipeline(...) held
     M + "residual standard\nparallel { pipeline(schedule: gpipe, cache: false) }\n", (),
     'spec.restopo', 3, 12,
     "the parallel section is missing 'stages'",
     'add them: pipeline(stages: 2, schedule: gpipe, cache: false)'),
    ('parallel_missing_stages_in_braces',
     M + "residual standard\nparallel { microbatches: 4 }\n", (),
     'spec.restopo', 3, 1,
     "the parallel section is missing 'stages'",
     "add them, e.g. 'stages: 2'"),
    ('parallel_empty',  # was accepted, where pipeline(cache: false) was missing stages
     M + "residual standard\nparallel { }\n", (),
     'spec.restopo', 3, 1,
     "the parallel section is empty: it asks for no pipeline and no data-parallel engine",
     "e.g. parallel { pipeline(stages: 2, microbatches: 4) } or parallel { data: fsdp }; or "
     "remove the section"),
    ('pipeline_key_beside_data_without_stages',  # was accepted, and unused by train
     M + "residual standard\nparallel { data: fsdp; microbatches: 4 }\n", (),
     'spec.restopo', 3, 24,
     "'microbatches' is for a pipeline, but the parallel section has no stages",
     "add stages, e.g. parallel { pipeline(stages: 2, microbatches: 4) }, or remove "
     "'microbatches'"),
    ('set_virtual_without_stages',  # was shown as 'pipeline 1x2', which train refused
     M + "residual standard\n", ("parallel.virtual=2",),
     '<--set 1>', 1, 24,
     "virtual stages need a pipeline, but the parallel section has no stages",
     "add --set parallel.stages=2 (or more); to train, --pipeline 2x2 gives both"),
    ('quoted_engine_in_parallel',  # was: '"fsdp"' is training data; train { data: "fsdp" }
     M + 'residual standard\nparallel { data: "fsdp" }\n', (),
     'spec.restopo', 3, 18,
     "'data' must be one of ddp or fsdp, got '\"fsdp\"'",
     "write it without the quotes: data: fsdp"),
    ('brace_inside_braces',  # was: this '{' (line 3, col 7) is never closed, yet it was
     M + "residual standard\ntrain { { steps: 3 } }\n", (),
     'spec.restopo', 3, 9,
     "unexpected '{' inside the braces opened at line 3",
     "braces do not nest: a section's entries are 'key: value'; remove this '{' and the '}' "
     "that closes it"),
    ('sections_inside_braces_closed_after_them',  # was: model's '{' is never closed
     M.replace(" }", "") + "residual standard\ntrain { steps: 3 }\n}\n", (),
     'spec.restopo', 2, 1,
     "the residual section is inside the model section's braces",
     "close the model section with '}' before 'residual': sections do not nest"),
    ('dotted_key_as_set_names_it',  # was: paths are quoted: write "train.steps:"
     M + "residual standard\ntrain.steps: 3  # quick\n", (),
     'spec.restopo', 3, 6,
     "unexpected character '.'",
     "write 'train { steps: 3 }' (train.steps is how --set names it)"),
    ('dotted_key_inside_its_section',
     M + "residual standard\ntrain { lr: 1e-3; train.steps: 3 }\n", (),
     'spec.restopo', 3, 24,
     "unexpected character '.'",
     "inside braces a key is written alone: 'steps: 3' (train.steps is how --set names it)"),
    ('number_with_thousands_commas',  # was: in braces, entries are separated by ';' ...
     M.replace("vocab: 256", "vocab:32,000") + "residual standard\n", (),
     'spec.restopo', 1, 17,
     "unexpected ','",
     "numbers are written without ',': write 32000 (or 32_000)"),
    ('set_number_with_thousands_commas',  # was: --set gives one value, and a list's ...
     M + "residual standard\n", ("train.steps=1,000,000",),
     '<--set 1>', 1, 20,
     "unexpected ','",
     "numbers are written without ',': write 1000000 (or 1_000_000)"),
    ('number_with_thousands_blanks',  # was: remove the extra values; ...
     M.replace("vocab: 256", "vocab: 32 000") + "residual standard\n", (),
     'spec.restopo', 1, 19,
     "'vocab' takes one value, got 2 (32 000)",
     "numbers are written without blanks: write 32000 (or 32_000)"),
    ('digit_of_another_script',  # was: expected a name, a number or a "quoted string"
     M.replace("width: 64", "width: \u0666\u0664") + "residual standard\n", (),
     'spec.restopo', 1, 28,
     "unexpected character '\u0666' (U+0666 ARABIC-INDIC DIGIT SIX)",
     "write '6' instead; outside strings and comments a spec is ASCII"),
    ('option_without_its_colon',  # was: takes named options, e.g. block_attnres(blocks: 8)
     M + "residual block_attnres(blocks 2, gate softmax)\n", (),
     'spec.restopo', 2, 24,
     "a ':' is missing after 'blocks'",
     "write block_attnres(blocks: 2, gate: softmax)"),
    ('set_key_with_an_empty_section',  # was: e.g. --set model.width=64 or --set residual=...
     M + "residual standard\n", (".steps=30",),
     '<--set 1>', 1, 7,
     "an override is written section.key=value, got '.steps=30'",
     "name its section: --set train.steps=30"),
    ('rule_key_with_a_dash',  # was: write 'before_sublayer', itself refused
     M + "residual custom { before-sublayer: attend(embedding, blocks, partial) }\n", (),
     'spec.restopo', 2, 25,
     "unexpected character '-'",
     "a rule is written 'before sublayer:'"),
    ('toml_table_head',  # was: lists are written as names separated by spaces: write 'train'
     M + "residual standard\n[train]\nsteps = 3\n", (),
     'spec.restopo', 3, 1,
     "unexpected character '['",
     "a section is written 'train { key: value ... }', its entries in braces"),
    ('number_hint_on_its_own_line',  # was: paths are quoted: write "3.5", with line 3's 3
     M + "residual standard\ntrain { steps: 3\n.5 }\n", (),
     'spec.restopo', 4, 1,
     "unexpected character '.'",
     "write the number as 0.5"),
    ('unit_in_the_other_case',  # was: units: x (a ratio), k (thousand), M (million); ...
     M + "residual standard\ntrain { steps: 3K }\n", (),
     'spec.restopo', 3, 16,
     "unknown unit 'K' in '3K'",
     "units are case-sensitive: write 3k for thousands"),
    ('number_as_a_fraction',  # was: paths are quoted: write "1/1000"
     M + "residual standard\ntrain { lr: 1/1000 }\n", (),
     'spec.restopo', 3, 14,
     "unexpected character '/'",
     "write the number as 0.001"),
    ('heads_in_train',  # was: expected one of: data, steps, batch, ... (19 keys)
     M + "residual standard\ntrain { heads: 8 }\n", (),
     'spec.restopo', 3, 9,
     "unknown key 'heads' in train",
     "'heads' belongs in the model section: model { heads: 8 }"),
    ('steps_zero', M + "residual standard\ntrain { steps: 0 }\n", (),
     'spec.restopo', 3, 16,
     "'steps' must be at least 1, got 0",
     'the number of optimizer steps'),
    ('lr_not_positive', M + "residual standard\ntrain { lr: 0 }\n", (),
     'spec.restopo', 3, 13,
     "'lr' must be greater than 0, got 0",
     'e.g. lr: 3e-3'),
    ('unknown_lr_schedule', M + "residual standard\ntrain { schedule: cosin }\n", (),
     'spec.restopo', 3, 19,
     "unknown schedule 'cosin'",
     "did you mean 'cosine'?"),
    ('bad_data_form', M + "residual standard\ntrain { data: 42 }\n", (),
     'spec.restopo', 3, 15,
     "bad data '42'",
     'data is written builtin:NAME or as a quoted path, e.g. data: "corpus.txt"'),
    ('data_path_with_nul',  # was a ValueError traceback from check and train (os.stat)
     M + 'residual standard\ntrain { data: "a\x00b.txt" }\n', (),
     'spec.restopo', 3, 15,
     "the data path holds a NUL character (U+0000)",
     "remove it: no file's path holds one"),
    ('unknown_builtin_data', M + "residual standard\ntrain { data: builtin:stdlb }\n", (),
     'spec.restopo', 3, 23,
     "unknown builtin corpus 'stdlb'",
     "did you mean 'stdlib'?"),
    ('unknown_data_kind', M + "residual standard\ntrain { data: bultin:stdlib }\n", (),
     'spec.restopo', 3, 15,
     "unknown data kind 'bultin:'",
     "data is builtin:NAME or a quoted path; did you mean 'builtin'?"),
    ('data_given_twice',  # was "unknown key 'builtin'": the second read as a key
     M + "residual standard\ntrain { data: builtin:stdlib builtin:stdlib }\n", (),
     'spec.restopo', 3, 30,
     "'data' takes one value, got 2 (builtin:stdlib builtin:stdlib)",
     "remove the extra values; put each entry on its own line or separate entries with ';'"),
    ('data_given_twice_set',  # was taken as one path, 'builtin:stdlib builtin:stdlib'
     M + "residual standard\n", ("train.data=builtin:stdlib builtin:stdlib",),
     '<--set 1>', 1, 33,
     "'data' takes one value, got 2 (builtin:stdlib builtin:stdlib)",
     "remove the extra values; put each entry on its own line or separate entries with ';'"),
    ('data_without_its_key', M + "residual standard\ntrain { steps: 3; builtin:stdlib }\n", (),
     'spec.restopo', 3, 19,
     "expected 'key: value' in train, got 'builtin:stdlib'",
     "write 'data: builtin:stdlib'"),
    ('warmup_longer_than_steps', M + "residual standard\ntrain { steps: 10; warmup: 30 }\n", (),
     'spec.restopo', 3, 28,
     'warmup (30) is longer than steps (10)',
     'warmup counts optimizer steps and must be at most steps'),
    ('min_lr_above_lr', M + "residual standard\ntrain { lr: 1e-3; min_lr: 1e-2 }\n", (),
     'spec.restopo', 3, 27,
     'min_lr (1e-2) is above lr (0.001)',
     'min_lr is where the cosine schedule ends; keep it at most lr'),
    ('unknown_train_key', M + "residual standard\ntrain { stpes: 10 }\n", (),
     'spec.restopo', 3, 9,
     "unknown key 'stpes' in train",
     "did you mean 'steps'?"),
    ('override_warmup_longer_than_steps', M + "residual standard\ntrain { steps: 10 }\n",
     ("train.warmup=30",),
     '<--set 1>', 1, 20,
     'warmup (30) is longer than steps (10)',
     'warmup counts optimizer steps and must be at most steps'),
    ('override_warmup_and_steps', M + "residual standard\n",
     ("train.warmup=30", "train.steps=10"),
     '<--set 1>', 1, 20,
     'warmup (30) is longer than steps (10)',
     'warmup counts optimizer steps and must be at most steps'),
    # a stream method's sources are all or none: rezero(embedding) was taken as rezero()
    # with a head rule, and without one called a wiring that reaches no head
    ('stream_method_part_of_its_sources', M + "residual custom {\n  before sublayer: "
     "rezero(embedding)\n  before head: attend(embedding, sublayers)\n}\n", (),
     'spec.restopo', 3, 20,
     "rezero updates one running stream and always reads the embedding and every earlier "
     "sublayer; it cannot leave out sublayers",
     'write rezero() or rezero(embedding, sublayers)'),
    # a window read with every earlier output was absorbed into it without a word
    ('window_inside_sublayers', M + "residual custom {\n  before sublayer: "
     "attend(embedding, sublayers, window(2))\n}\n", (),
     'spec.restopo', 3, 49,
     "'window(2)' reads outputs 'sublayers' already reads (every earlier one): together "
     "they are just 'sublayers'",
     "keep one: 'sublayers' for every earlier output, or the window for the last few"),
    # settings `restopo train` refuses together are refused by the check too (spec.combos)
    ('compile_whole_with_recompute_sublayer',
     M + "residual standard\ntrain { compile: whole; recompute: sublayer }\n", (),
     'spec.restopo', 3, 18,
     "train.compile: whole does not combine with train.recompute: sublayer (its checkpoint "
     "hooks do not trace into one graph)",
     "use train.recompute: block, or train.compile: regional"),
    ('recompute_block_in_a_pipeline',
     M + "residual standard\nparallel { pipeline(stages: 2) }\ntrain { recompute: block }\n",
     (),
     'spec.restopo', 4, 20,
     "train.recompute=block recomputes regions of the whole lowered model, which a pipeline "
     "stage does not run",
     "use train.recompute=sublayer with a pipeline"),
    ('compile_whole_with_fsdp', M + "residual standard\nparallel { data: fsdp }\n",
     ("train.compile=whole",),
     '<--set 1>', 1, 21,
     "train.compile: whole compiles the model as one graph, for one process or DDP, not a "
     "pipeline or FSDP",
     "use train.compile: regional (--set train.compile=regional), which compiles what "
     "each process runs"),
    # a value past any key's reach still names this key's own bound (it said 2,147,483,647)
    ('streams_past_any_bound', M + "residual hyper_connections(streams: 99999999999999999999)\n",
     (),
     'spec.restopo', 2, 37,
     "'streams' must be at most 16, got 99999999999999999999",
     'the number of residual streams, each of width d (the papers use 1 to 8)'),
    ('number_in_hex',  # was: unknown unit 'x40' in '0x40'
     M.replace("width: 64", "width: 0x40") + "residual standard\n", (),
     'spec.restopo', 1, 28,
     "'width' is written in base 16, got 0x40",
     "numbers are decimal: write width: 64"),
    # and one far below zero its lower bound (it was "'warmup' is too large: -99999999999")
    ('warmup_past_any_bound_below', M + "residual standard\ntrain { warmup: -99999999999 }\n",
     (),
     'spec.restopo', 3, 17,
     "'warmup' must be at least 0, got -99999999999",
     'e.g. warmup: 30'),
    ('lr_past_any_bound_below', M + "residual standard\ntrain { lr: -1e400 }\n", (),
     'spec.restopo', 3, 13,
     "'lr' must be greater than 0, got -1e400",
     'e.g. lr: 3e-3'),
    # an error relating two values points at the one the command line changed
    ('override_width_against_files_heads', M + "residual standard\n", ("model.width=6",),
     '<--set 1>', 1, 19,
     'heads (4) must divide width (6)',
     'heads that divide 6 with an even head size: 1, 3'),
    ('override_lr_below_files_min_lr', M + "residual standard\ntrain { min_lr: 1e-4 }\n",
     ("train.lr=1e-5",),
     '<--set 1>', 1, 16,
     'min_lr (1e-4) is above lr (1e-05)',
     'min_lr is where the cosine schedule ends; keep it at most lr'),
    ('override_batch_against_files_accum', M + "residual standard\ntrain { accum: 4 }\n",
     ("train.batch=6",),
     '<--set 1>', 1, 19,
     'accum (4) must divide batch (6)',
     'each accumulation step takes batch/accum sequences'),
    ('override_unknown_key', M + "residual standard\n", ("model.widht=64",),
     '<--set 1>', 1, 13,
     "unknown key 'widht' in model",
     "did you mean 'width'?"),
    ('override_unknown_section', M + "residual standard\n", ("modle.width=64",),
     '<--set 1>', 1, 7,
     "unknown section 'modle' in --set modle.width=64",
     "did you mean 'model'?"),
    # a key without its section: the section it belongs to is said (it listed the sections)
    ('override_key_without_its_section', M + "residual standard\n", ("width=64",),
     '<--set 1>', 1, 7,
     "unknown section 'width' in --set width=64",
     "did you mean --set model.width=64?"),
    ('override_no_equals', M + "residual standard\n", ("model.width",),
     '<--set 1>', 1, 7,
     "an override is written section.key=value, got 'model.width'",
     'e.g. --set model.width=64 or --set residual=full_attnres'),
    ('override_bad_value', M + "residual standard\n", ("train.lr=abc",),
     '<--set 1>', 1, 16,
     "'lr' must be a number, got 'abc'",
     'e.g. --set train.lr=3e-3'),
    ('override_syntax', M + "residual standard\n", ("residual=block_attnres(blocks: 2",),
     '<--set 1>', 1, 29,
     "this '(' is never closed",
     "add ')' to close it"),
    ('override_blocks_not_allowed', M + "residual block_attnres(blocks: 2)\n", ("residual.blocks=7",),
     '<--set 1>', 1, 23,
     'blocks must be between 1 and 4 (the number of transformer layers), or 8 (one block per sublayer, Full AttnRes); got 7',
     'for depth 4 (8 sublayers) blocks may be 1, 2, 3, 4 or 8; 8 gives one block per sublayer (Full AttnRes)'),
    ('override_missing_value', M + "residual standard\n", ("train.steps=",),
     '<--set 1>', 1, 19,
     "missing value after '=' in --set train.steps=",
     'e.g. --set train.steps=...'),
    ('section_takes_no_name', M + "residual standard\ntrain fast { steps: 3 }\n", (),
     'spec.restopo', 3, 7,
     "the train section takes no name, got 'fast'",
     "write 'train { ... }'"),
    ('topology_not_a_name', M + "residual 3\n", (),
     'spec.restopo', 2, 10,
     "expected a topology name after 'residual', got '3'",
     "e.g. 'residual standard' or 'residual block_attnres(blocks: 8)'"),
    ('mlp_ratio_twice', M.replace("context: 64", "context: 64; mlp: gelu(2x); mlp_ratio: 3x")
     + "residual standard\n", (),
     'spec.restopo', 1, 80,
     "the MLP ratio is given twice (mlp: ...(ratio) and mlp_ratio:)",
     "keep one of them"),
    ('stream_method_option', M + "residual custom {\n  before sublayer: rezero(gate: softmax)\n}\n", (),
     'spec.restopo', 3, 27,
     "option 'gate' does not apply to rezero",
     "rezero takes no options (attend takes query, gate, key_norm or heads; scalars takes gate)"),
    ('scalars_attend_option',
     M + "residual custom {\n  before sublayer: scalars(embedding, sublayers; key_norm: none)\n}\n", (),
     'spec.restopo', 3, 50,
     "option 'key_norm' does not apply to scalars",
     "scalars takes only gate (none, softmax or sigmoid); query, key_norm and heads are options of attend"),
    ('denseformer_attend_option', M + "residual denseformer(heads: 4)\n", (),
     'spec.restopo', 2, 22,
     "option 'heads' does not apply to denseformer",
     "'heads' is an option of full_attnres or block_attnres; denseformer takes gate"),
    ('full_attnres_stream_option', M + "residual full_attnres(streams: 4)\n", (),
     'spec.restopo', 2, 23,
     "option 'streams' does not apply to full_attnres",
     "'streams' is an option of hyper_connections, mhc or mhc_lite; full_attnres takes query, "
     "gate, key_norm, heads or window"),
    ('attend_gate_none', M + "residual full_attnres(gate: none)\n", (),
     'spec.restopo', 2, 29,
     "gate 'none' applies to scalars only: depth attention normalises its weights with softmax or sigmoid",
     "use gate: softmax or gate: sigmoid; unnormalised static weights per source are scalars(embedding, sublayers), as in residual denseformer"),
    ('key_outside_section', "width: 64\nresidual standard\n", (),
     'spec.restopo', 1, 6,
     "unexpected ':'",
     "'width' belongs in the model section: model { width: 64 }"),
    ('train_key_outside_section',  # was: e.g. 'model { steps: ... }', not its section
     M + "residual standard\nsteps: 3  # quick\n", (),
     'spec.restopo', 3, 6,
     "unexpected ':'",
     "'steps' belongs in the train section: train { steps: 3 }"),
    ('option_after_a_one_line_head',  # was: e.g. 'model { blocks: ... }'
     M + "residual block_attnres blocks: 2\n", (),
     'spec.restopo', 2, 30,
     "unexpected ':'",
     "options go in parentheses: residual block_attnres(blocks: 2)"),
    ('key_as_a_section',  # was: sections are model, residual, parallel and train
     M + "residual standard\nlr 3e-3\n", (),
     'spec.restopo', 3, 1,
     "unknown section 'lr'",
     "'lr' belongs in the train section: train { lr: 3e-3 }"),
    ('syntax_unclosed_string',  # was "unexpected character '\"'", expected a quoted string
     M + 'residual standard\ntrain { data: "corpus.txt\n  steps: 3 }\n', (),
     'spec.restopo', 3, 15,
     "this '\"' is never closed",
     'end the string with " on the same line, e.g. data: "corpus.txt"'),
    ('syntax_curly_quotes', M + 'residual standard\ntrain { data: \u201ccorpus.txt\u201d }\n', (),
     'spec.restopo', 3, 15,
     "unexpected character '\u201c'",
     'strings use plain double quotes ("): write "corpus.txt"'),
    ('syntax_single_quotes',  # was: e.g. data: "corpus.txt", whatever the string
     M + "residual standard\ntrain { data: 'my data.txt' }\n", (),
     'spec.restopo', 3, 15,
     "unexpected character \"'\"",
     'strings use double quotes: write "my data.txt"'),
    ('syntax_list_in_brackets',  # was: e.g. 'layer: attn mlp', whatever the list
     M.replace(" }", "; layer: [attn, mlp, mlp] }") + "residual standard\n", (),
     'spec.restopo', 1, 72,
     "unexpected character '['",
     "lists are written as names separated by spaces: write 'layer: attn mlp mlp'"),
    ('syntax_no_break_space',  # was "unexpected character '\xa0'", expected a name, ...
     M.replace("{ vocab", "{\u00a0vocab") + "residual standard\n", (),
     'spec.restopo', 1, 8,
     "unexpected character U+00A0 NO-BREAK SPACE",
     "write a plain space instead; outside strings and comments a spec is ASCII"),
    ('syntax_full_width_colon', M.replace("depth:", "depth\uff1a") + "residual standard\n", (),
     'spec.restopo', 1, 37,
     "unexpected character '\uff1a' (U+FF1A FULLWIDTH COLON)",
     "write ':' instead; outside strings and comments a spec is ASCII"),
    ('syntax_accented_letter', M.replace("width", "w\u00eddth") + "residual standard\n", (),
     'spec.restopo', 1, 22,
     "unexpected character '\u00ed' (U+00ED LATIN SMALL LETTER I WITH ACUTE)",
     "names and keys are ASCII letters, digits and '_': write 'width'"),
    ('syntax_zero_width_space', M + "residual\u200b standard\n", (),
     'spec.restopo', 2, 9,
     "unexpected character U+200B ZERO WIDTH SPACE",
     "remove it: an invisible character, often pasted in with the text"),
    ('label_of_two_words',  # was: the model section needs braces, and unknown section 'gpt'
     M.replace("model {", "model tiny gpt {") + "residual standard\n", (),
     'spec.restopo', 1, 12,
     "a section's label is one name, got 'tiny gpt'",
     "join the words: 'model tiny_gpt { ... }'"),
    ('train_named_with_two_words',
     M + "residual standard\ntrain quick run { steps: 3 }\n", (),
     'spec.restopo', 3, 7,
     "the train section takes no name, got 'quick run'",
     "write 'train { ... }'"),
    ('syntax_number_without_a_leading_digit',  # was: paths are quoted
     M + "residual standard\ntrain { lr: .003 }\n", (),
     'spec.restopo', 3, 13,
     "unexpected character '.'",
     "write the number as 0.003"),
    ('set_number_with_a_plus',  # was: expected a name, a number or a "quoted string"
     M + "residual standard\n", ("train.lr=+3e-3",),
     '<--set 1>', 1, 16,
     "unexpected character '+'",
     "write the number as 3e-3"),
    ('topology_as_a_section',  # was: sections are model, residual, parallel and train
     M + "residual standard rezero\ntrain { steps: 3 }\n", (),
     'spec.restopo', 2, 19,
     "unknown section 'rezero'",
     "'rezero' is a topology: write 'residual rezero' (a spec has one residual section)"),
    ('topology_as_a_section_at_the_end',  # was: unexpected end of file, expected a name...
     M + "residual standard rezero  # rezero\n", (),
     'spec.restopo', 2, 19,
     "unknown section 'rezero'",
     "'rezero' is a topology: write 'residual rezero' (a spec has one residual section)"),
    ('pipeline_schedule_in_train',  # was: unknown schedule '1f1b', expected cosine, constant
     M + "residual standard\ntrain { schedule: 1f1b }\n", (),
     'spec.restopo', 3, 19,
     "'1f1b' is a pipeline schedule, not a learning-rate schedule",
     "it goes in the parallel section: parallel { schedule: 1f1b }"),
    ('training_data_in_parallel',  # was: 'data' must be one of ddp or fsdp, got '"a.txt"'
     M + 'residual standard\nparallel { data: "a.txt" }\n', (),
     'spec.restopo', 3, 18,
     "'\"a.txt\"' is training data, not a data-parallel engine",
     "it goes in the train section: train { data: \"a.txt\" }"),
    ('data_engine_in_train',  # was: bad data 'fsdp'
     M + "residual standard\ntrain { data: fsdp }\n", (),
     'spec.restopo', 3, 15,
     "'fsdp' is a data-parallel engine, not training data",
     "it goes in the parallel section: parallel { data: fsdp }"),
    ('data_engine_in_train_set',  # was: data path '.../fsdp' does not exist
     M + "residual standard\n", ("train.data=fsdp",),
     '<--set 1>', 1, 18,
     "'fsdp' is a data-parallel engine, not training data",
     "it goes in the parallel section: --set parallel.data=fsdp; a data file of that name: "
     "--set train.data=./fsdp"),
    ('pipeline_schedule_in_train_set',  # was the file's form: parallel { schedule: 1f1b }
     M + "residual standard\n", ("train.schedule=1f1b",),
     '<--set 1>', 1, 22,
     "'1f1b' is a pipeline schedule, not a learning-rate schedule",
     "it goes in the parallel section: --set parallel.schedule=1f1b"),
    ('set_shared_key_without_section_engine',  # was: expected one of: model, residual, ...
     M + "residual standard\n", ("data=fsdp",),
     '<--set 1>', 1, 7,
     "unknown section 'data' in --set data=fsdp",
     "did you mean --set parallel.data=fsdp?"),
    ('set_shared_key_without_section_lr_schedule',
     M + "residual standard\n", ("schedule=cosine",),
     '<--set 1>', 1, 7,
     "unknown section 'schedule' in --set schedule=cosine",
     "did you mean --set train.schedule=cosine?"),
    ('set_shared_key_without_section_path',
     M + "residual standard\n", ("data=data/c.txt",),
     '<--set 1>', 1, 7,
     "unknown section 'data' in --set data=data/c.txt",
     "did you mean --set train.data=data/c.txt?"),
    ('set_shared_key_without_section_either',
     M + "residual standard\n", ("schedule=linear",),
     '<--set 1>', 1, 7,
     "unknown section 'schedule' in --set schedule=linear",
     "'schedule' is a key of two sections: --set train.schedule=linear for a learning-rate "
     "schedule, --set parallel.schedule=linear for a pipeline schedule"),
    ('set_path_in_parallel_data',  # was: unexpected character '.', paths are quoted
     M + "residual standard\n", ("parallel.data=data/c.txt",),
     '<--set 1>', 1, 21,
     "'data/c.txt' is training data, not a data-parallel engine",
     "it goes in the train section: --set train.data=data/c.txt"),
    ('set_two_engines',  # not 'ddp,fsdp' as training data
     M + "residual standard\n", ("parallel.data=ddp,fsdp",),
     '<--set 1>', 1, 24,
     "unexpected ','",
     "--set gives one value, and a list's values are separated by spaces (--set "
     "'model.layer=attn mlp'); to compare several values, use restopo sweep SPEC --vary "
     "KEY=V1,V2"),
    ('data_engine_as_parallelism',  # was: unknown parallelism 'fsdp', restopo plans pipelines
     M + "residual standard\nparallel fsdp\n", (),
     'spec.restopo', 3, 10,
     "'fsdp' is a value of parallel.data, given without its key",
     "write parallel { data: fsdp }"),
    ('set_pipeline_schedule_as_parallelism',  # was: unknown parallelism 'gpipe'
     M + "residual standard\n", ("parallel=gpipe",),
     '<--set 1>', 1, 16,
     "'gpipe' is a value of parallel.schedule, given without its key",
     "write --set parallel.schedule=gpipe"),
    ('set_with_a_colon',  # was: e.g. --set model.width=64 or --set residual=full_attnres
     M + "residual standard\n", ("train.steps: 20",),
     '<--set 1>', 1, 7,
     "an override is written section.key=value, got 'train.steps: 20'",
     "write --set train.steps=20"),
    ('set_section_and_key_apart',  # was: did you mean 'train'?
     M + "residual standard\n", ("train steps=20",),
     '<--set 1>', 1, 7,
     "unknown section 'train steps' in --set train steps=20",
     "write --set train.steps=20"),
    ('rule_in_a_named_topology',  # was: unknown option 'before sublayer' for block_attnres
     M + "residual block_attnres {\n  before sublayer: attend(embedding, blocks, partial)\n"
     "  blocks: 2\n}\n", (),
     'spec.restopo', 3, 3,
     "'before sublayer:' is a rule of custom wiring, and block_attnres is a named topology",
     "label custom wiring with a name of its own: residual my_wiring { before sublayer: ... }"),
    ('set_rule_of_a_named_topology',
     M + "residual block_attnres(blocks: 2)\n", ("residual.before_head=attend(embedding, blocks)",),
     '<--set 1>', 1, 16,
     "'before head:' is a rule of custom wiring, and block_attnres is a named topology",
     "the spec's residual is block_attnres; custom wiring is written in the spec file: "
     "residual my_wiring { before head: ... }"),
    ('set_stray_close',  # was: check the opening '(' above, on a one-line --set
     M + "residual standard\n", ("residual=mhc(streams: 2))",),
     '<--set 1>', 1, 31,
     "unexpected ')': nothing is open here",
     "remove it, or check the opening '(' before it"),
    ('duplicate_key_after_pipeline',  # was said at the first, pipeline's stages (column 21)
     M + "residual standard\nparallel { pipeline(stages: 2, microbatches: 4); stages: 4 }\n", (),
     'spec.restopo', 3, 50,
     "duplicate key 'stages' in parallel (first given at line 3)",
     "remove one of them"),
    ('misspelt_residual_section',  # was first: the spec has no residual section
     M + "Residual block_attnres(blocks: 2)\n", (),
     'spec.restopo', 2, 1,
     "unknown section 'Residual'",
     "sections are model, residual, parallel and train; did you mean 'residual'?"),
    ('key_in_capitals',  # was: expected one of: vocab, width, ... (difflib is case-sensitive)
     M.replace("width", "WIDTH") + "residual standard\n", (),
     'spec.restopo', 1, 21,
     "unknown key 'WIDTH' in model",
     "did you mean 'width'?"),
    ('syntax_line_separator',  # was: expected a name, a number, a "quoted string" or '{'
     M + "residual\u2028standard\n", (),
     'spec.restopo', 2, 9,
     "unexpected character U+2028 LINE SEPARATOR",
     "write a plain space or a new line instead; outside strings and comments a spec is "
     "ASCII"),
    ('syntax_quoted_key',  # was: expected a name, a number, ..., '}' or ';'
     M + 'residual standard\ntrain { "steps": 3 }\n', (),
     'spec.restopo', 3, 16,
     "unexpected ':'",
     "keys are written without quotes: 'steps:'"),
    ('syntax_call_with_brackets',  # was the hint for lists: names separated by spaces
     M + "residual custom {\n  before sublayer: attend[embedding, sublayers]\n}\n", (),
     'spec.restopo', 3, 26,
     "unexpected character '['",
     "a call's arguments go in parentheses: write attend(embedding, sublayers)"),
    ('syntax_stream_call_with_brackets',  # was: e.g. attend(embedding, sublayers)
     M + "residual custom {\n  before sublayer: mhc[streams: 2]\n}\n", (),
     'spec.restopo', 3, 23,
     "unexpected character '['",
     "a call's arguments go in parentheses: write mhc(streams: 2)"),
    ('syntax_hyphen_in_name', M.replace("model {", "model my-model {") + "residual standard\n",
     (), 'spec.restopo', 1, 9,
     "unexpected character '-'",
     "names are letters, digits and '_': write 'my_model'"),
    ('syntax_commas_between_entries',  # was: expected a name, ..., '}' or ';'
     M.replace("; width", ", width") + "residual standard\n", (),
     'spec.restopo', 1, 19,
     "unexpected ','",
     "in braces, entries are separated by ';' or a new line and a list's values by spaces "
     "(layer: attn mlp); ',' separates a call's arguments"),
    ('syntax_comment_took_the_paren',  # was "add ')' to close it", beside the ')'
     M + "residual block_attnres(blocks: 2  # two blocks)\n", (),
     'spec.restopo', 2, 23,
     "this '(' is never closed",
     "the '#' on line 2 starts a comment that runs to the end of the line, so the ')' after "
     "it is part of the comment; put the ')' before the '#'"),
    ('syntax_comment_took_the_brace',
     "model { vocab: 256; width: 64; depth: 4; heads: 4\n  context: 64 # the model }\n"
     "residual standard\ntrain { steps: 3 }\n", (),
     'spec.restopo', 1, 7,
     "this '{' is never closed",
     "the '#' on line 2 starts a comment that runs to the end of the line, so the '}' after "
     "it is part of the comment; put the '}' before the '#'"),
    ('set_value_with_commas',  # was: expected nothing more
     M + "residual standard\n", ("model.layer=attn,mlp",),
     '<--set 1>', 1, 23,
     "unexpected ','",
     "--set gives one value, and a list's values are separated by spaces (--set "
     "'model.layer=attn mlp'); to compare several values, use restopo sweep SPEC --vary "
     "KEY=V1,V2"),
    ('set_value_with_a_semicolon',  # was: expected nothing more
     M + "residual standard\n", ("model.width=64;",),
     '<--set 1>', 1, 21,
     "unexpected ';'",
     "--set gives one value, with nothing after it; give each setting its own --set, e.g. "
     "--set model.width=64 --set model.depth=2"),
    ('set_two_settings',  # was: paths are quoted
     M + "residual standard\n", ("model.width=64 model.depth=2",),
     '<--set 1>', 1, 27,
     "unexpected character '.'",
     "--set gives one value, with nothing after it; give each setting its own --set, e.g. "
     "--set model.width=64 --set model.depth=2"),
    ('set_custom_wiring',  # was: expected a name, a number, ... '(', ':' or ';'
     M + "residual standard\n", ("residual=custom { before sublayer: rezero() }",),
     '<--set 1>', 1, 23,
     "unexpected '{'",
     "--set residual=VALUE takes a one-line topology (e.g. residual=full_attnres); write "
     "custom wiring in the spec file, or change a rule of the file's custom wiring with "
     "--set 'residual.before_sublayer=...'"),
    ('syntax_control_character', M + "residual standard\x00\n", (),
     'spec.restopo', 2, 18,
     "unexpected character U+0000",
     "remove it: an invisible character, often pasted in with the text"),
    ('syntax_c_comment',  # was: paths are quoted
     M + "residual block_attnres(blocks: 2  // two blocks\n)\n", (),
     'spec.restopo', 2, 35,
     "unexpected character '/'",
     "comments start with '#' and run to the end of the line"),
    ('syntax_end_of_file', M + "residual\n\n# the end\n", (),
     'spec.restopo', 2, 9,
     "unexpected end of file",
     "expected a name, a number, a \"quoted string\" or '{' after 'residual'"),
    ('set_option_of_a_topology_without_options',  # was "write 'residual standard'"
     M + "residual standard\n", ("residual.blocks=2",),
     '<--set 1>', 1, 16,
     "'standard' takes no options, got 'blocks'",
     "the spec's residual is standard, and --set residual.KEY sets an option of that "
     "topology; to use block_attnres: --set 'residual=block_attnres(blocks: 2)'"),
    ('set_misspelt_option_of_a_topology_without_options',
     M + "residual rezero\n", ("residual.windw=4",),
     '<--set 1>', 1, 16,
     "'rezero' takes no options, got 'windw'",
     "the spec's residual is rezero, and --set residual.KEY sets an option of that "
     "topology; to use full_attnres: --set 'residual=full_attnres(window: 4)'"),
    ('set_topology_without_options_given_one',  # was: --set residual.KEY sets an option...
     M + "residual rezero\n", ("residual=standard(blocks: 2)",),
     '<--set 1>', 1, 25,
     "'standard' takes no options, got 'blocks'",
     "write --set residual=standard; to use block_attnres: --set "
     "'residual=block_attnres(blocks: 2)'"),
    ('topology_without_options_given_a_value',  # was: write options as 'key: value'
     M + "residual highway(2)\n", (),
     'spec.restopo', 2, 18,
     "'highway' takes no options, got '2'",
     "write 'residual highway'"),
    ('set_topology_without_options_given_a_value',
     M + "residual standard\n", ("residual=rezero(2)",),
     '<--set 1>', 1, 23,
     "'rezero' takes no options, got '2'",
     "write --set residual=rezero"),
]


@pytest.mark.parametrize("case", GOLDEN, ids=[c[0] for c in GOLDEN])
def test_golden_error(case):
    name, text, overrides, path, line, column, message, hint = case
    with pytest.raises(SpecError) as info:
        parse_spec(text, "spec.restopo", overrides)
    err = info.value.errors[0] if isinstance(info.value, SpecErrors) else info.value
    assert (err.path, err.line, err.column) == (path, line, column)
    assert err.message == message
    assert err.hint == hint
    # the rendered form names the place, shows the line and puts the caret under the column
    rendered = err.render()
    first, shown, caret = rendered.split("\n")[:3]  # (a line may hold a U+2028)
    assert first == f"{path}:{line}:{column}: error: {message}"
    assert caret.index("^") - 4 == column - 1
    if hint:
        assert rendered.split("\n")[3] == f"hint: {hint}"


def test_golden_cases_are_distinct():
    assert len(GOLDEN) >= 30
    assert len({c[0] for c in GOLDEN}) == len(GOLDEN)
    assert len({c[6] for c in GOLDEN}) >= 30, "at least 30 distinct messages"


def test_a_quick_run_may_shorten_steps_below_the_files_warmup():
    """`--steps 10` (or --set train.steps=10) for a quick try of a spec whose warmup is
    longer: the schedule stays in warmup, as a person trying a short run expects."""
    spec = parse_spec(M + "residual standard\ntrain { steps: 100; warmup: 30 }\n",
                      overrides=("train.steps=10",))
    assert (spec.train.steps, spec.train.warmup) == (10, 30)


def test_the_caret_lands_under_its_character_past_wide_and_combining_ones():
    """The caret was placed by characters: one column short after each CJK character (two
    columns wide), one column long after each combining accent (none)."""
    for before, extra in (("日本語データ", +6), ("e\u0301e\u0301e\u0301", -3), ("abc", 0)):
        text = M + f'residual standard\ntrain {{ data: "{before}.txt"; steps: 0 }}\n'
        with pytest.raises(SpecError) as e:
            parse_spec(text, path="spec.restopo")
        _, line, caret = str(e.value).splitlines()[:3]
        assert caret.index("^") == line.index("0 }") + extra


def test_a_parallel_section_of_set_values_alone_needs_no_stages():
    """--pipeline gives the stages, so `--set parallel.cache=false` beside it was refused as
    'the parallel section is missing stages' (a section in the file still needs them)."""
    from restopo.spec import parse_spec
    from restopo.train import layout
    spec = parse_spec(M + "residual standard\n", overrides=("parallel.cache=false",))
    assert spec.parallel.cache is False and not spec.parallel.pipelined
    piped = layout.resolve("2x1", spec.parallel, 2).pipeline
    assert (piped.stages, piped.cached) == (2, False)
    with pytest.raises(SpecError, match="missing 'stages'"):
        parse_spec(M + "residual standard\nparallel { pipeline(cache: false) }\n")


@pytest.mark.parametrize("section,overrides", [
    ("parallel { }", ()), ("parallel pipeline", ()), ("parallel { pipeline() }", ()),
    ("parallel { pipeline(cache: false) }", ()),
    ("parallel { cache: true }", ("parallel.cache=false",)),
    ("", ("parallel=pipeline",)), ("parallel { data: fsdp; virtual: 2 }", ()),
    ("parallel { data: fsdp }", ("parallel.virtual=2",)),
    ("", ("parallel=pipeline(virtual: 2)",)), ("parallel { pipeline(schedule: gpipe) }", ())])
def test_a_parallel_section_that_plans_no_pipeline_asks_for_none(section, overrides):
    """`parallel { }` (and `parallel pipeline`) passed check where `pipeline(cache: false)`
    was missing its stages, and virtual stages without stages (--set parallel.virtual=2)
    passed as 'pipeline 1x2', which train refused: a section that says nothing, and
    pipeline keys where no stages are, are refused in every form; --set values of the
    other pipeline keys stand beside --pipeline, which gives the stages."""
    with pytest.raises(SpecError, match="missing 'stages'|is empty|has no stages"):
        parse_spec(M + f"residual standard\n{section}\n", "spec.restopo", overrides)
    for beside in ("parallel.cache=false", "parallel.microbatches=4", "parallel.virtual=1",
                   "parallel=pipeline(schedule: gpipe)"):
        spec = parse_spec(M + "residual standard\n", "spec.restopo", (beside,))
        assert not spec.parallel.pipelined


@pytest.mark.parametrize("entry,bad", [
    ("width: 64", "width: 0"), ("heads: 4", "heads: -1"), ("warmup: 30", "warmup: -1"),
    ("schedule: cosine", "schedule: 1.5"), ("steps: 600", "steps: 0"),
    ("mlp: swiglu(4x)", "mlp: swiglu(0x)"), ("blocks: 2", "blocks: 99999999999"),
    ("lr: 3e-3", "lr: -1"), ("schedule: cosine", 'schedule: "cosine"')])
def test_every_refused_value_comes_with_a_hint(entry, bad):
    """Bounds without a reason of their own (width: 0, warmup: -1, a number where a word is
    chosen) were reported with no hint line; each now says how the key is written."""
    from pathlib import Path
    text = (Path(__file__).parent.parent / "examples" / "tiny.restopo").read_text()
    assert entry in text
    with pytest.raises(SpecError) as info:
        parse_spec(text.replace(entry, bad, 1), "spec.restopo")
    errs = info.value.errors if isinstance(info.value, SpecErrors) else [info.value]
    assert all(e.hint for e in errs), [(e.message, e.hint) for e in errs]


def test_underscores_between_digits_still_group_them():
    spec = parse_spec(M.replace("width: 64", "width: 6_4") + "residual standard\n"
                      + "train { steps: 1_000 }\n", overrides=("train.warmup=1_0",))
    assert (spec.model.width, spec.train.steps, spec.train.warmup) == (64, 1000, 10)


def test_a_misspelt_rule_is_one_error_not_two():
    """'befor sublayer:' is said as an unknown rule; that custom wiring then lacks its
    'before sublayer:' rule was said first, at the section, as a second mistake."""
    text = M + "residual custom {\n  befor sublayer: attend(embedding, sublayers)\n}\n"
    with pytest.raises(SpecError) as info:
        parse_spec(text, "spec.restopo")
    assert not isinstance(info.value, SpecErrors), str(info.value)
    assert (info.value.line, info.value.message) == (3, "unknown rule 'befor sublayer:'")
    for key, said in (("before sublayers:", "unknown rule target 'sublayers'"),
                      ("sublayer:", "unknown key 'sublayer' in custom wiring")):
        text = M + f"residual custom {{\n  {key} attend(embedding, sublayers)\n}}\n"
        with pytest.raises(SpecError) as info:
            parse_spec(text, "spec.restopo")
        assert not isinstance(info.value, SpecErrors), str(info.value)
        assert info.value.message == said
    # a wiring with no rule at all still says what it needs
    with pytest.raises(SpecError, match="custom wiring needs a 'before sublayer:' rule"):
        parse_spec(M + "residual custom {\n  blocks: 2\n}\n", "spec.restopo")


@pytest.mark.parametrize("rule,hint", [
    ("sum(embedding, attend(sublayers, window(3)))", "e.g. sum(embedding, sublayers)"),
    ("rezero(embedding, sum(sublayers))", "e.g. rezero(embedding, sublayers)")])
def test_a_method_nested_among_sources_says_how_to_list_them(rule, hint):
    """The sources listed flat, with no window beside 'sublayers' (refused), and no blocks
    for a stream method, which cannot read them; said once, not again as a source the
    stream method cannot read."""
    text = M + f"residual custom {{\n  before sublayer: {rule}\n}}\n"
    with pytest.raises(SpecError) as info:
        parse_spec(text, "spec.restopo")
    assert not isinstance(info.value, SpecErrors), str(info.value)
    assert info.value.message.startswith("sources do not nest")
    assert info.value.hint.endswith(hint)


def test_a_stream_method_with_a_misspelt_source_is_one_error():
    text = M + "residual custom {\n  before sublayer: highway(embedding, sublayerz)\n}\n"
    with pytest.raises(SpecError) as info:
        parse_spec(text, "spec.restopo")
    assert not isinstance(info.value, SpecErrors), str(info.value)
    assert (info.value.message, info.value.hint) == ("unknown source 'sublayerz'",
                                                     "did you mean 'sublayers'?")


@pytest.mark.parametrize("entry", ["window: 4", "streams: 4", "gate: softmax", "sinkhorn: 3",
                                   "query: static", "key_norm: rms", "dynamic: true",
                                   "blocks: 2"])
@pytest.mark.parametrize("section", ["model", "train", "parallel"])
def test_a_topology_option_in_another_section_is_shown_its_topology(entry, section):
    """`window: 4` in the model section was an unknown key with the model's keys listed
    (`streams: 4` in train: did you mean 'steps'?): only blocks, block_size and heads were
    known as options of the residual topology. Each option now is, shown in a topology
    that takes it, and the line suggested checks."""
    import re
    text = {"model": M.replace(" }", f"; {entry} }}") + "residual standard\n",
            "train": M + f"residual standard\ntrain {{ {entry} }}\n",
            "parallel": M + f"residual standard\nparallel {{ stages: 2; {entry} }}\n"}[section]
    with pytest.raises(SpecError) as info:
        parse_spec(text, "spec.restopo")
    assert info.value.message == f"unknown key '{entry.split(':')[0]}' in {section}"
    line = re.fullmatch(r"'\w+' is an option of the residual topology, e\.g\. (residual .*)",
                        info.value.hint)
    assert line, info.value.hint
    parse_spec(M + line.group(1) + "\n", "spec.restopo")


@pytest.mark.parametrize("wiring", [
    "window: 4; before sublayer: attend(embedding, blocks, partial)",
    "gate: softmax; before sublayer: attend(embedding, blocks, partial)",
    "key_norm: rms; before sublayer: attend(embedding, blocks, partial)",
    "sinkhorn: 3; before sublayer: attend(embedding, blocks, partial)",
    "dynamic: true; before sublayer: attend(embedding, blocks, partial)",
    "before sublayer: attend(embedding, blocks, partial; window: 4)",
    "before sublayer: sum(embedding, sublayers; window: 2)"])
def test_a_topology_option_in_custom_wiring_is_shown_in_its_rule(wiring):
    """`window: 4` in custom wiring (or as an option of attend) was an unknown key or option
    with the custom keys (or attend's options) listed: custom wiring says a window as a
    source of its rule, and attend's options after ';' in the rule. Each is now shown
    so, in a rule that checks."""
    import re
    with pytest.raises(SpecError) as info:
        parse_spec(M + f"residual custom {{ {wiring} }}\n", "spec.restopo")
    rule = re.search(r"(?:before sublayer: |a window is a source: )(.*)$", info.value.hint)
    assert "is not" in info.value.message and rule, (info.value.message, info.value.hint)
    parse_spec(M + f"residual custom {{ before sublayer: {rule.group(1)} }}\n", "spec.restopo")


def test_a_rule_key_joined_by_an_underscore_is_one_error():
    """`before_sublayer:` (as --set writes it) in custom wiring was said as an unknown key
    and again as the wiring having no 'before sublayer:' rule."""
    with pytest.raises(SpecError) as info:
        parse_spec(M + "residual custom { before_sublayer: attend(embedding, sublayers) }\n",
                   "spec.restopo")
    assert not isinstance(info.value, SpecErrors), str(info.value)
    assert info.value.hint == "did you mean 'before sublayer'?"


def test_a_section_inside_another_is_one_error():
    """`residual standard` before the model section's '}' was said as the spec having no
    residual section and as extra values of the entry before it ('context' takes one value,
    got 3): two mistakes, neither the one made."""
    text = M.replace(" }", "\n  residual block_attnres(blocks: 2) }")
    with pytest.raises(SpecError) as info:
        parse_spec(text, "spec.restopo")
    assert not isinstance(info.value, SpecErrors), str(info.value)
    assert (info.value.line, info.value.column) == (2, 3)
    assert info.value.message == "the residual section is inside the model section's braces"
    assert info.value.hint == ("close the model section with '}' before 'residual': sections "
                               "do not nest")


def test_a_stream_count_without_its_key_is_one_error():
    with pytest.raises(SpecError) as info:
        parse_spec(M + "residual hyper_connections(4)\n", "spec.restopo")
    assert not isinstance(info.value, SpecErrors), str(info.value)
    assert info.value.hint == "write hyper_connections(streams: 4)"


S = "residual standard\n"


@pytest.mark.parametrize("text,overrides,hint", [
    (M.replace(" }", '; mlp: gelu("4x") }') + S, (), "write it without the quotes: gelu(4x)"),
    (M + 'residual full_attnres(window: "8")', (), "write it without the quotes: window: 8"),
    (M + S, ('model.mlp=gelu("2x")',), "write it without the quotes: --set model.mlp=gelu(2x)"),
    (M + S + "train { steps: 50 steps }", (), "write the number alone: steps: 50"),
    (M + S, ("train.steps=50 steps",), "write the number alone: --set train.steps=50"),
    (M + S, ("model.mlp=gelu 2x",), "write --set model.mlp=gelu(2x), or mlp: gelu and"),
    (M + "residual block_attnres(blocks: 2, gate: \"sigmoid\")", (),
     "write it without the quotes: gate: sigmoid"),
    (M + S, ('train.schedule="constant"',),
     "write it without the quotes: --set train.schedule=constant"),
    (M + "residual custom { before sublayer: attend(embedding sublayers, gate: sigmoid) }", (),
     "write attend(embedding, sublayers, gate: sigmoid)"),
    (M + "residual custom { before sublayer: mhc(embedding, streams: 2, sinkhorn: 5) }", (),
     "write mhc(streams: 2, sinkhorn: 5)"),
    (M.replace(" }", "; mlp: gelu(fast) }") + S, (), "e.g. gelu(4x)"),
    (M + 'residual block_attnres(blocks:\t"2")', (), "write it without the quotes: blocks: 2"),
    (M.replace(" }", "; mlp: 3x }") + S, (), "a ratio goes with its kind: mlp: swiglu(3x), or "
                                             "mlp_ratio: 3x"),
    (M.replace(" }", '; mlp: "gelu" }') + S, (), "write it without the quotes: mlp: gelu"),
    (M + "residual full_attnres(window: x)", (), "e.g. window: 8"),
    (M + S, ("train.steps=many",), "e.g. --set train.steps=300"),
    (M + S + "train { schedule: 3 }", (), "e.g. schedule: cosine"),
    (M + S, ("train.schedule=3",), "e.g. --set train.schedule=cosine"),
], ids=["quoted_ratio", "quoted_option", "quoted_ratio_set", "unit_word", "unit_word_set",
        "ratio_outside_parentheses_set", "quoted_choice", "quoted_choice_set",
        "sources_without_commas", "stream_rule_sources", "ratio_not_a_number", "tab",
        "ratio_without_kind", "quoted_kind",
        "option_not_a_number", "not_a_number_set", "choice_not_a_word", "choice_not_a_word_set"])
def test_a_hint_that_rewrites_a_value_keeps_the_other_words(text, overrides, hint):
    """A hint that corrects one value wrote the rest from the key's example: gelu("4x") was
    told to write swiglu(4x), window: "8" window(8), `50 steps` steps: 300, and a stream
    rule or sources without commas lost their options, and a quoted word of a choice got
    the key's first choice (gate: "sigmoid": e.g. gate: softmax); each now rewrites what
    was typed. A value that cannot be rewritten (gelu(fast)) gets its example in the
    words typed (e.g. gelu(4x), not swiglu(4x); window: 8 in full_attnres, not a rule's
    window(8); a --set as a --set)."""
    with pytest.raises(SpecError) as info:
        parse_spec(text + "\n", "spec.restopo", overrides)
    err = info.value.errors[0] if isinstance(info.value, SpecErrors) else info.value
    assert err.hint.startswith(hint), err.hint


def test_a_set_with_a_line_break_is_shown_on_one_line():
    """A --set holding a line break (pasted, or from a file read by the shell) had its
    error shown over two lines, the caret under neither; a trailing break is a blank, and
    any other is said where it is, on one line."""
    with pytest.raises(SpecError) as info:
        parse_spec(M + "residual standard\n", "spec.restopo", ("train.steps=x\r\n",))
    assert str(info.value).splitlines()[:3] == [
        "<--set 1>:1:19: error: 'steps' must be a number, got 'x'",
        "    --set train.steps=x  ", "    " + " " * 18 + "^"]
    assert parse_spec(M + "residual standard\n", overrides=("train.steps=3\r\n",)
                      ).train.steps == 3


@pytest.mark.parametrize("text,conflict", [
    (M + 'residual block_attnres(blocks: x; block_size: "2")\n',
     "give either 'blocks' or 'block_size', not both"),
    (M.replace(" }", '; mlp: gelu(x); mlp_ratio: "3" }') + S,
     "the MLP ratio is given twice (mlp: ...(ratio) and mlp_ratio:)")],
    ids=["blocks", "mlp_ratio"])
def test_two_keys_of_one_setting_have_each_value_checked_too(text, conflict):
    """blocks and block_size given together (or an MLP ratio in mlp: and mlp_ratio:) were
    said only to conflict: once one was removed, the other's mistake came next. Each
    value's mistake is said as well, in source order."""
    with pytest.raises(SpecErrors) as info:
        parse_spec(text, "spec.restopo")
    said = [e.message for e in info.value.errors]
    assert conflict in said and len(said) == 3, said
    assert said[0].endswith("must be a number, got 'x'")
    assert said[2].endswith("""must be a number, got '"2"'""" if "block" in text
                            else """must be a number, got '"3"'""")


@pytest.mark.parametrize("newline", ["\r", "\r\n"])
def test_spec_text_with_other_line_breaks_is_read_as_a_file_is(newline):
    """Text given to parse_spec (or restopo.compile) with lone CR line breaks put every error
    on line 1 at a column past the line shown, with a hint cut from the wrong line ('e.g.
    300'), and a leading byte-order mark was an unexpected character; such text is now
    read as a spec file is (line breaks as '\\n', the mark dropped)."""
    text = M + "residual standard\ntrain { steps: x }\n"
    with pytest.raises(SpecError) as expected:
        parse_spec(text, "spec.restopo")
    with pytest.raises(SpecError) as got:
        parse_spec("\ufeff" + text.replace("\n", newline), "spec.restopo")
    assert str(got.value) == str(expected.value)


T = M + S + "train { @ }\n"


@pytest.mark.parametrize("text,typed,message,hint", [
    (M + S, "width 64", "a ':' is missing after 'width'", "width: 64"),
    (M + S, "vocab: 256 width 64 depth 4 heads 4 context 64", "a ':' is missing after 'width'",
     "vocab: 256; width: 64; depth: 4; heads: 4; context: 64"),
    (T, "steps 3 lr 1e-3", "a ':' is missing after 'steps'", "steps: 3; lr: 1e-3"),
    (T, 'data: "a.txt" steps 3', "a ':' is missing after 'steps'", 'data: "a.txt"; steps: 3'),
    (M + S + "parallel { @ }\n", "stages 2", "a ':' is missing after 'stages'", "stages: 2"),
    (T, "lr", "'lr' is given no value", "e.g. 'lr: 3e-3'"),
    (M.replace("width: 64", "@") + S, "width", "'width' is given no value",
     "e.g. 'width: 64'"),
    (M + S + "parallel { @ }\n", "stages", "'stages' is given no value", "e.g. 'stages: 2'"),
    (T, "width", "'width' is given no value", "model { width: 64 }"),
    (T, "window", "'window' is given no value", "residual full_attnres(window: ...)"),
    (T.replace(S, ""), "standard", "'standard' is written in the train section",
     "residual standard"),
    (M.replace(" }", "; @ }"), "block_attnres(blocks: 2)",
     "'block_attnres(blocks: 2)' is written in the model section",
     "residual block_attnres(blocks: 2)"),
    (T, "pipeline(stages: 2)", "'pipeline(stages: 2)' is written in the train section",
     "parallel { pipeline(stages: 2) }")])
def test_a_key_without_its_colon_is_one_error_saying_how_to_write_it(text, typed, message,
                                                                     hint):
    """`width 64` was said as 'expected key: value, got width 64' with the hint 'e.g.
    width: 64', and again as the model missing 'width'; `vocab: 256 width 64 ...` as four
    keys missing and vocab taking 9 values; `parallel { stages }` as an unknown
    parallelism 'stages'; `lr` alone, a topology in the model section or pipeline(...) in
    train got a section's example. Each is one error, and a line its hint writes checks."""
    given = text.replace("@", typed) if "@" in text else text.replace(hint, typed)
    with pytest.raises(SpecError) as info:
        parse_spec(given, "spec.restopo")
    assert not isinstance(info.value, SpecErrors), str(info.value)
    assert info.value.message == message
    assert hint in info.value.hint
    if info.value.hint == f"write '{hint}'":  # the entries as they should be
        parse_spec(given.replace(typed, hint), "spec.restopo")


@pytest.mark.parametrize("text", [
    M + S + "train { steps: 3; @ }\n", M + S + "train { steps: @ }\n", M + S + "@ { }\n",
    M + S + "train { @: 3 }\n", M + "residual @\n", M + S + "train { data: builtin:@ }\n",
    M + S + "train { steps: 3@ }\n", M + "residual custom { before sublayer: attend(@) }\n",
    M + S + 'train { schedule: "@" }\n', M + S + "train { steps: " + "1 " * 2000 + "}\n"])
def test_a_long_word_is_said_in_a_line_of_its_own_size(text):
    """A name of 3,000 characters (a paste gone wrong) was quoted whole in its message
    ("unknown section 'xxx...'", 3,000 columns wide), as was a list of 2,000 values; a
    name, key or unit past MAX_WORD characters is now refused as such where it starts,
    and a value quoted in a message is cut short."""
    text = text.replace("@", "x" * 3000)
    with pytest.raises(SpecError) as info:
        parse_spec(text, "spec.restopo")
    err = info.value.errors[0] if isinstance(info.value, SpecErrors) else info.value
    assert max(map(len, str(err).splitlines())) <= 200, str(err)
    row = text.splitlines()[err.line - 1]
    assert row[err.column - 1] in "x13\"", (err.line, err.column)


@pytest.mark.parametrize("setting", ["model.@=1", "@=1", "residual.@=1", "model.@=",
                                     "model. @=1", "train.@=3", "model.width.@=1"])
def test_a_long_word_in_a_set_is_said_as_in_a_file(setting):
    """--set model.<3,000 characters>=1 was quoted whole ("unknown key 'xxx...' in model",
    3,000 columns wide; an unknown section and a missing value quoted the whole --set):
    keys from --set never met the lexer's MAX_WORD. A section or key past it is now refused
    as the file's lexer refuses one, where it starts."""
    with pytest.raises(SpecError) as file:
        parse_spec(M + S + "train { @: 3 }\n".replace("@", "x" * 3000), "spec.restopo")
    with pytest.raises(SpecError) as info:
        parse_spec(M + S, "spec.restopo", (setting.replace("@", "x" * 3000),))
    err = info.value.errors[0] if isinstance(info.value, SpecErrors) else info.value
    assert err.hint == file.value.hint
    said = r"a word of [0-9,]+ characters: '[\w.]{20}\.\.\.'"
    assert re.fullmatch(said, err.message) and re.fullmatch(said, file.value.message)
    assert max(map(len, str(info.value).splitlines())) <= 200, str(info.value)
    assert ("--set " + setting)[err.column - 1] in "w@", err.column


@pytest.mark.parametrize("inside", ["\f", "\v", "\x1c", "\x85", "\u2028"])
def test_an_error_shows_the_line_its_position_is_in(inside):
    """A form feed between two lines (or a vertical tab, U+2028, ...) ends a line for
    str.splitlines() but not for the parser: `steps: 0` on line 3 was shown under line 2's
    text ('residual standard'), its caret nowhere near the 0."""
    text = M + f"{inside}residual standard\ntrain {{ steps: 0 }}\n"
    with pytest.raises(SpecError) as info:
        parse_spec(text, "spec.restopo")
    err = info.value.errors[0] if isinstance(info.value, SpecErrors) else info.value
    _, shown, caret = err.render().split("\n")[:3]
    at = caret.index("^") - 4
    if "unexpected character" in err.message:  # not a blank to the lexer: said where it is
        assert shown[4:].startswith(inside) and at == 0, (shown, caret)
    else:
        assert "steps: 0" in shown and shown[4 + at] == "0", (shown, caret)


@pytest.mark.parametrize("first,again", [
    ("width: 64", "width: abc"), ("steps: 3", "steps: -1"),
    ("blocks: 2", "blocks: x"), ("stages: 2", "stages: 0"),
    ("before sublayer: attend(embedding, sublayers)",
     "before sublayer: atend(embedding, sublayers)")])
def test_a_key_given_twice_has_its_later_value_checked_too(first, again):
    """`width: 64; width: abc` was said only as a duplicate key: the mistake in 'abc' came
    once the first was removed. It is said beside the duplicate, as it is said alone."""
    section = {"width": M.replace("width: 64", "@") + S, "steps": M + S + "train { @ }\n",
               "blocks": M + "residual block_attnres(@)\n",
               "stages": M + S + "parallel { pipeline(@, microbatches: 2) }\n",
               "before": M + "residual custom { @ }\n"}[first.split(":")[0].split()[0]]
    sep = ", " if "(@" in section else "; "
    with pytest.raises(SpecError) as alone:
        parse_spec(section.replace("@", again), "spec.restopo")
    with pytest.raises(SpecErrors) as info:
        parse_spec(section.replace("@", first + sep + again), "spec.restopo")
    said = [(e.message, e.hint) for e in info.value.errors]
    assert said[0][0].startswith("duplicate key") and len(said) == 2, said
    assert said[1] == (alone.value.message, alone.value.hint)
    assert info.value.errors[1].column == alone.value.column + len(first + sep)


@pytest.mark.parametrize("text,first,later", [
    (M.replace("width: 64", "@") + S, "width: 64", "width: 66"),    # heads must divide it
    (M.replace("width: 64", "@") + S, "width: 64", "width: 65"),
    (M + S + "train { warmup: 10; @ }\n", "steps: 100", "steps: 5"),
    (M + S + "train { @; accum: 4 }\n", "batch: 16", "batch: 6"),
    (M + S + "parallel { @ }\n", "stages: 2", "stages: 16"),  # more chunks than sublayers
    (M + S + "parallel { stages: 2; @ }\n", "microbatches: 4", "microbatches: 3"),
    (M.replace("depth: 4", "@") + "residual block_attnres(blocks: 4)\n", "depth: 4",
     "depth: 3")])
def test_a_key_given_twice_has_its_later_value_checked_with_the_others(text, first, later):
    """`width: 64` then `width: 65` beside `heads: 4` was said only as a duplicate key: the
    later value was checked alone, never against the others (heads must divide width),
    which came once the first was removed. The spec as it reads with the later value is
    checked as a whole: all it says alone is said beside the duplicate."""
    key = first.split(":")[0]
    with pytest.raises(SpecError) as alone:
        parse_spec(text.replace("@", later), "spec.restopo")
    with pytest.raises(SpecErrors) as info:
        parse_spec(text.replace("@", first + "; " + later), "spec.restopo")
    said = [e.message for e in info.value.errors]
    expected = getattr(alone.value, "errors", [alone.value])
    assert f"duplicate key '{key}' in " in said[0] + said[-1], said
    assert {e.message for e in expected} <= set(said), said
    parse_spec(text.replace("@", first), "spec.restopo")  # the first alone is right


@pytest.mark.parametrize("typed,overrides,hint", [
    ("hyper_connections(3)", (), "write hyper_connections(streams: 3)"),
    ("mhc_lite( 2 )", (), "write mhc_lite( streams: 2 )"),
    ("mhc(4, 20)", (), "write mhc(streams: 4, sinkhorn: 20)"),
    ("mhc(sinkhorn: 5, 4)", (), "write mhc(sinkhorn: 5, streams: 4)"),
    ("hyper_connections(2, true)", (), "write hyper_connections(streams: 2, dynamic: true)"),
    ("denseformer(none)", (), "write denseformer(gate: none)"),
    ("full_attnres(input_dependent)", (), "write full_attnres(query: input_dependent)"),
    ("block_attnres(blocks: 2, none)", (), "write block_attnres(blocks: 2, key_norm: none)"),
    ("block_attnres(blocks: 2, sigmoid)", (), "write block_attnres(blocks: 2, gate: sigmoid)"),
    ("standard", ("residual=mhc(2)",), "write --set residual=mhc(streams: 2)"),
    # a number several options take: the example stays
    ("block_attnres(8)", (), "e.g. block_attnres(blocks: 8) or block_attnres(block_size: 4)"),
    ("full_attnres(8)", (), "e.g. full_attnres(query: input_dependent) or full_attnres("
                            "window: 8)")])
def test_a_topology_option_without_its_key_is_named_in_the_words_typed(typed, overrides, hint):
    """`hyper_connections(3)` got the example hyper_connections(streams: 4), not what was
    typed with its key: a value that can only be one option of its topology (a word of that
    option's choices, a number for streams) is now named in the call as written."""
    with pytest.raises(SpecError) as info:
        parse_spec(M + f"residual {typed}\n", "spec.restopo", overrides)
    errs = info.value.errors if isinstance(info.value, SpecErrors) else [info.value]
    assert {e.hint for e in errs} == {hint}, [e.hint for e in errs]
    assert all("takes named options" in e.message for e in errs)


@pytest.mark.parametrize("typed,hint", [
    ("pipeline(2)", "write pipeline(stages: 2)"),
    ("pipeline(stages: 2, 1f1b)", "write pipeline(stages: 2, schedule: 1f1b)"),
    ("pipeline(2, fsdp, false)", "write pipeline(stages: 2, data: fsdp, cache: false)")])
def test_a_pipeline_option_without_its_key_is_named_in_the_words_typed(typed, hint):
    """As for a topology: `pipeline(1f1b)` got the example pipeline(stages: 2,
    microbatches: 4), not the schedule typed with its key."""
    with pytest.raises(SpecError) as info:
        parse_spec(M + f"residual standard\nparallel {{ {typed} }}\n", "spec.restopo")
    errs = info.value.errors if isinstance(info.value, SpecErrors) else [info.value]
    assert {e.hint for e in errs} == {hint}, [e.hint for e in errs]


@pytest.mark.parametrize("rule,hint", [
    ("mhc(3)", "write mhc(streams: 3)"),
    ("mhc(embedding, 3, 20)", "write mhc(streams: 3, sinkhorn: 20)"),
    ("hyper_connections(embedding, sublayerz)", "write hyper_connections(streams: 4)")])
def test_a_stream_rule_given_values_without_keys_is_one_error(rule, hint):
    """`before sublayer: mhc(3)` was said twice at the 3 (expected a source; mhc reads the
    streams, not sources) and told to write mhc(streams: 4); a stream rule's values are not
    read as sources, and one that can only be an option is named with its key."""
    text = M + f"residual custom {{\n  before sublayer: {rule}\n}}\n"
    with pytest.raises(SpecError) as info:
        parse_spec(text, "spec.restopo")
    assert not isinstance(info.value, SpecErrors), str(info.value)
    assert info.value.message.endswith("reads the n residual streams, not sources")
    assert info.value.hint == hint


@pytest.mark.parametrize("vary,hint", [
    ("width=32,64", "did you mean --vary model.width=32,64?"),
    ("data=ddp,fsdp", "did you mean --vary parallel.data=ddp,fsdp?"),
    ("model width=32,64", "write --vary model.width=32,64")])
def test_a_vary_without_its_section_is_said_as_typed(vary, hint):
    """--vary width=32,64 was said as 'unknown section in --set width=64', a --set never
    typed, with the hint --set model.width=64 for one of its values; it is said as the
    --vary typed, and the hint corrects its key."""
    from restopo.spec.overrides import FlagOverride
    with pytest.raises(SpecError) as info:
        parse_spec(M + S, "spec.restopo", FlagOverride.vary(vary))
    errs = info.value.errors if isinstance(info.value, SpecErrors) else [info.value]
    key = vary.partition("=")[0]
    assert {(e.message, e.hint) for e in errs} == {
        (f"unknown section '{key}' in --vary {vary}", hint)}


@pytest.mark.parametrize("setting", ["residual.blocks=-1", "residual.blocks=64",
                                     "residual.window=0", "residual.query=foo",
                                     "residual.sinkhorn=3", "residual.heads=3",
                                     "residual.blocks=2", "residual.gate=softmax",
                                     "residual.streams=2"])
def test_a_topology_suggested_for_a_set_option_is_one_the_checker_takes(setting):
    """--set residual.blocks=-1 on a standard residual was told to use --set
    'residual=block_attnres(blocks: -1)', refused in turn; a topology is suggested only
    where the checker takes it, and else the hint says why it would be refused."""
    with pytest.raises(SpecError) as info:
        parse_spec(M + "residual standard\n", "spec.restopo", (setting,))
    hint = info.value.hint
    suggested = re.search(r"--set '(residual=[^']*)'", hint)
    if suggested:
        parse_spec(M + "residual standard\n", "spec.restopo", (suggested[1],))
    else:
        with pytest.raises(SpecError) as refused:
            parse_spec(M + "residual standard\n", "spec.restopo",
                       ("residual=" + re.search(r"but (\w+\([^)]*\)) is refused", hint)[1],))
        assert hint.endswith(f"is refused too: {refused.value.message}")


@pytest.mark.parametrize("typed,fixed,errors", [
    ("mhc(streams 4 sinkhorn 3)", "mhc(streams: 4, sinkhorn: 3)", 1),
    ("mhc(streams: 4 sinkhorn 3)", "mhc(streams: 4, sinkhorn: 3)", 1),
    ("mhc(sinkhorn 3 streams 4)", "mhc(sinkhorn: 3, streams: 4)", 1),
    ("mhc(streams 4, sinkhorn 3)", "mhc(streams: 4, sinkhorn: 3)", 2),
    ("full_attnres(query: static gate sigmoid heads 2)",
     "full_attnres(query: static, gate: sigmoid, heads: 2)", 1)])
def test_options_written_without_colons_in_one_call_are_each_written_out(typed, fixed, errors):
    """`mhc(streams 4 sinkhorn 3)` was told to write mhc(streams: 4 sinkhorn 3), itself
    refused ('streams' takes one value, got 3), as `mhc(streams: 4 sinkhorn 3)` was; each
    option's ':' (and the ',' before it) is now written in the hint, which the checker
    takes, in one error per argument."""
    with pytest.raises(SpecError) as info:
        parse_spec(M + f"residual {typed}\n", "spec.restopo")
    said = info.value.errors if isinstance(info.value, SpecErrors) else [info.value]
    assert len(said) == errors, str(info.value)
    assert all(e.message.startswith("a ':' is missing after") for e in said)
    assert all(e.hint == f"write {fixed}" for e in said)
    parse_spec(M + f"residual {fixed}\n", "spec.restopo")


@pytest.mark.parametrize("typed", [
    "block_attnres(blocks 0)", "block_attnres(blocks 2)", "hyper_connections(-1)",
    "hyper_connections(3)", "mhc(streams 4, sinkhorn -2)", "mhc(sinkhorn 3)",
    "block_attnres(blocks 2 4)", "full_attnres(gate sigmoid)"])
def test_a_topology_a_hint_writes_out_is_one_the_checker_takes(typed):
    """`block_attnres(blocks 0)` was told to write block_attnres(blocks: 0), and
    `hyper_connections(-1)` hyper_connections(streams: -1), each refused in turn; a call a
    hint writes out is now checked first, and where the checker refuses it the hint says
    why."""
    with pytest.raises(SpecError) as info:
        parse_spec(M + f"residual {typed}\n", "spec.restopo")
    hint = info.value.hint
    call, refused, why = hint.removeprefix("write ").partition(" would still be refused: ")
    if not refused:
        parse_spec(M + f"residual {call}\n", "spec.restopo")
    else:
        with pytest.raises(SpecError) as again:
            parse_spec(M + f"residual {call}\n", "spec.restopo")
        assert why == again.value.message
