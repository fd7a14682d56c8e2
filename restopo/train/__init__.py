"""Training: `restopo train` and `restopo diagnose`.

data        corpora (builtin:stdlib, text, uint16 .bin) and the seeded global-batch sampler
loop        the training loop over any model(idx) -> logits
stepper     how a step's gradients are made: the Stepper interface, data parallel (pipeline
            parallel: restopo.backends.pipeline.train)
checkpoint  atomic safetensors checkpoints with a checksum manifest, verified before use;
            `latest` pointer, resume from the newest that verifies
runlock     one run per run folder (an flock that names its holder)
dist        torchrun launch and the process group inside each worker
torchrun    torchrun's entry point, without its traceback when a worker fails
plots       loss curves and the diagnose figures (PNG)
diagnose    output magnitude, gradient norm and depth-attention weights of a checkpoint
runspec     spec (file or checkpoint copy) -> seeded model and data
"""
