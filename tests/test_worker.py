"""restopo.worker.leave: how a torchrun worker ends."""
import ast
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

SCRIPT = """
import atexit, logging, sys
from restopo.worker import leave
atexit.register(lambda: print("teardown ran", file=sys.stderr))
logging.basicConfig(stream=sys.stderr)
logging.getLogger("x").warning("logged")
sys.stdout.write("said, unflushed")  # no newline: still in the buffer when leave() runs
print("error line", file=sys.stderr)
leave(int(sys.argv[1]))
print("after leave", file=sys.stderr)
raise SystemExit(9)
"""


@pytest.mark.parametrize("code", [0, 3])
def test_a_worker_leaves_with_its_status_and_everything_it_said(code):
    env = dict(os.environ, RANK="0", WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(code)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == code
    assert proc.stdout == "said, unflushed"
    assert "logged" in proc.stderr and "error line" in proc.stderr
    # the interpreter's teardown (where torch's C++ teardown may abort) is skipped
    assert "teardown ran" not in proc.stderr and "after leave" not in proc.stderr


def test_outside_torchrun_leave_returns_and_the_process_ends_as_usual():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "3"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9
    assert "after leave" in proc.stderr and "teardown ran" in proc.stderr


ROOT = pathlib.Path(__file__).resolve().parent.parent
LAUNCHERS = ("torch.distributed.run", "restopo.train.torchrun")


def worker_scripts() -> set[pathlib.Path]:
    """Every script the repository runs under torchrun: the `-m` module a launcher command
    names, and a file that relaunches itself (`abspath(__file__)`) beside a launcher."""
    found = set()
    for path in ROOT.glob("[!.]*/**/*.py"):
        text = path.read_text()
        if not any(f'"{name}"' in text for name in LAUNCHERS):
            continue
        for module in re.findall(r'"-m",\s*"([\w.]+)"', text):
            if module not in LAUNCHERS:
                spec = importlib.util.find_spec(module)
                found.add(pathlib.Path(spec.origin if not spec.submodule_search_locations
                                       else os.path.join(spec.submodule_search_locations[0],
                                                         "__main__.py")).resolve())
        if "abspath(__file__)" in text and "--worker" in text:
            found.add(path.resolve())
    return found


def calls_exit_with(body: list) -> bool:
    return any(isinstance(node, ast.Call) and ast.unparse(node.func).endswith("exit_with")
               for stmt in body for node in ast.walk(stmt))


def ends_through_exit_with(path: pathlib.Path) -> bool:
    """The module's top level, or its `if __name__ == "__main__":` block, calls exit_with."""
    tree = ast.parse(path.read_text())
    mains = [node.body for node in tree.body
             if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
    return calls_exit_with([s for s in tree.body if not isinstance(s, ast.If)]) or any(
        calls_exit_with(body) for body in mains)


def test_python_m_restopo_ends_with_130_after_a_ctrl_c_inside_a_strings_exec(tmp_path):
    """Ctrl-C while torch's import made a dataclass (whose __init__ is code exec'd from a
    string): `python -m restopo` said 'restopo: interrupted', then ended by SIGINT (-2),
    not with its 130; a sweep or a script reads the two differently."""
    (tmp_path / "stopped").mkdir()
    (tmp_path / "stopped" / "__main__.py").write_text(
        "import runpy\n"
        "import restopo.commands.check as check\n"
        "def run(args):\n"
        "    exec('raise KeyboardInterrupt', {})\n"
        "check.run = run\n"
        "runpy.run_module('restopo', run_name='__main__', alter_sys=True)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), str(pathlib.Path(__file__).resolve().parents[1]),
         os.environ.get("PYTHONPATH", "")]))
    env.pop("RANK", None)
    main = "stopped"  # (not a script run under torchrun, which worker_scripts looks for)
    proc = subprocess.run([sys.executable, "-m", main, "check", "any.restopo"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (130, "restopo: interrupted\n")


def test_every_script_run_under_torchrun_exits_through_leave():
    """A torchrun worker that ends through the interpreter's teardown now and then aborts
    (gloo, SIGABRT) after a finished run: CI once failed on bench/fsdp_recompute.py's
    worker that way. Every script the repository launches under torchrun must end through
    restopo.worker.exit_with."""
    scripts = {p.relative_to(ROOT).as_posix(): p for p in worker_scripts()}
    # the finder sees the known workers (it would pass vacuously if it saw none)
    assert {"restopo/__main__.py", "bench/fsdp_recompute.py", "bench/memory.py",
            "restopo/train/layoutcheck.py", "backends/pipeline/selfcheck.py"} <= set(scripts)
    assert [n for n, p in sorted(scripts.items()) if not ends_through_exit_with(p)] == []


def test_the_restopo_console_script_exits_through_leave():
    """`torchrun --no-python restopo train ...` runs the console script, not -m restopo."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["restopo"]
    module, name = target.split(":")
    tree = ast.parse(pathlib.Path(importlib.util.find_spec(module).origin).read_text())
    (func,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert calls_exit_with(func.body)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
def test_a_parent_dead_before_die_with_parent_took_sends_the_signal_asked_for(
        monkeypatch, signum):
    """A parent that died between reading it and the prctl was answered with SIGTERM
    whatever signal was asked for: a torchrun worker (SIGKILL, to end at once with its
    killed agent) started its save instead."""
    import ctypes
    import signal
    import types

    from restopo import worker
    parents, sent = iter([100, 1]), []
    asked = []  # the prctl, not made on this test process
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: types.SimpleNamespace(
        prctl=lambda *args: asked.append(args)))
    monkeypatch.setattr(worker.os, "getppid", lambda: next(parents))
    monkeypatch.setattr(worker.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    worker.die_with_parent(getattr(signal, signum))
    assert asked == [(1, getattr(signal, signum), 0, 0, 0)]  # PR_SET_PDEATHSIG
    assert sent == [(os.getpid(), getattr(signal, signum))]
