"""Many processes: launching torchrun, and the process group inside each worker.

`restopo train --nproc N` re-runs itself under torchrun (`python -m restopo.train.torchrun`:
torch.distributed.run without its traceback) without --nproc and forwards the exit code. Inside a worker (RANK/WORLD_SIZE set by
torchrun) `setup()` joins the process group: gloo on CPU, NCCL on CUDA, with a timeout so a
collective never waits forever on a rank that died; torchrun's agent then stops the others
and exits non-zero, and the launcher says so in one line.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..worker import signals_handled, under_torchrun

# Seconds a collective may wait for the other ranks before the job fails (env override).
DEFAULT_TIMEOUT_S = 300
# A worker's exit status for a mistake rank 0 has already said in one line (the launcher then
# adds nothing).
USAGE_EXIT = 3
# A worker's exit status when its connection to another rank broke: that rank's failure is
# the cause, and the launcher names it (restopo.train.torchrun.first_failure).
LOST_PEER_EXIT = 4


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    cpu_group: object = None  # for collectives on CPU tensors (None: the default group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


@contextlib.contextmanager
def cpu_threads(n: int | None):
    """Run with `n` torch CPU threads (None: $OMP_NUM_THREADS when set, else 1), then put
    the old count back. The small models restopo trains on CPU gain little from more
    threads and slow down many times over when the cores are shared."""
    before = torch.get_num_threads()
    if n is not None or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(n or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def restart_count() -> int:
    """How many times torchrun has restarted this job (0 on the first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but torch sees no CUDA device; "
                               "use --device cpu")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def setup(device_choice: str = "auto") -> DistContext:
    """Join torchrun's process group if there is one; else a single-process context."""
    if not under_torchrun():
        return DistContext(device=pick_device(device_choice))
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_choice, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = dist_timeout()
    if world > 1 and not dist.is_initialized():
        # torchrun keeps its store across restarts: the keys of a killed attempt (a dead
        # rank's address) would be read by the next one, so each attempt gets its own prefix
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        store = dist.PrefixStore(f"restopo/attempt{restart_count()}/", store)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store,
                                timeout=timeout, rank=rank, world_size=world)
    # any_rank runs at every step: on CUDA over gloo, so it does not wait for the step's
    # kernels as reading back an NCCL result would
    cpu_group = dist.new_group(backend="gloo") if world > 1 and device.type == "cuda" else None
    return DistContext(rank, world, local_rank, device, cpu_group)


def dist_timeout() -> timedelta:
    """How long a collective waits for the other ranks: $RESTOPO_DIST_TIMEOUT seconds, else
    DEFAULT_TIMEOUT_S. RuntimeError, in one line, for a value that is not a number above 0
    (it failed in every worker, a traceback each)."""
    text = os.environ.get("RESTOPO_DIST_TIMEOUT")
    if text is None:
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= 1e9:  # nan and inf too: timedelta overflows past ~3e15 s
        raise RuntimeError(f"$RESTOPO_DIST_TIMEOUT must be a number of seconds above 0 (how "
                           f"long a collective waits for the other ranks; default "
                           f"{DEFAULT_TIMEOUT_S}), got {text!r}")
    return timedelta(seconds=seconds)


def cleanup(ctx: DistContext) -> None:
    if ctx.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        import torch.distributed as dist

        dist.barrier()


def mean_over_ranks(value: float, ctx: DistContext) -> float:
    """The mean of a number over all ranks (the number itself in one process)."""
    if not ctx.distributed:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64,
                     device=ctx.device if ctx.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.item() / ctx.world


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """Whether `flag` holds on any rank (the flag itself in one process)."""
    if not ctx.distributed:
        return flag
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
    return bool(t.item())


def exchange(ctx: DistContext, obj):
    """Every rank's JSON-able `obj`, in rank order ([obj] in one process); also a barrier.
    Sent as UTF-8 JSON bytes, so nothing is pickled."""
    if not ctx.distributed:
        return [obj]
    import torch.distributed as dist

    dev = ctx.device if ctx.device.type == "cuda" else torch.device("cpu")
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    n = torch.tensor([data.numel()], device=dev)
    sizes = [torch.zeros_like(n) for _ in range(ctx.world)]
    dist.all_gather(sizes, n)
    width = max(int(s.item()) for s in sizes)
    buf = torch.zeros(width, dtype=torch.uint8, device=dev)
    buf[:data.numel()] = data.to(dev)
    bufs = [torch.zeros_like(buf) for _ in range(ctx.world)]
    dist.all_gather(bufs, buf)
    return [json.loads(b[:int(s.item())].cpu().numpy().tobytes()) for b, s in zip(bufs, sizes)]


def collectively(ctx: DistContext, fn, errors: tuple[type[Exception], ...]):
    """fn() on every rank; when it raises one of `errors` on any rank, every rank raises the
    first such error (same class and message), so rank 0 can say it once and no rank waits
    for one that gave up."""
    failure = None
    try:
        result = fn()
    except errors as e:
        failure = [next(i for i, k in enumerate(errors) if isinstance(e, k)), str(e)]
        result = None
    if ctx.distributed:
        failure = next((f for f in exchange(ctx, failure) if f), None)
    if failure:
        raise errors[failure[0]](failure[1])
    return result


def lost_peer(e: BaseException) -> str | None:
    """What broke, in a few words, when `e` is this process losing its connection to another
    rank (gloo's transport: a peer's sockets closed as it died, or a collective timed out
    waiting for it; torch's own network errors); None for any other error."""
    from torch.distributed import DistNetworkError

    text = str(e)
    if "/gloo/transport/" in text:  # "[.../gloo/transport/tcp/pair.cc:537] Read error ..."
        text = text.split("] ", 1)[-1]
    elif not isinstance(e, DistNetworkError):
        return None
    return text.split(". ", 1)[0].strip().rstrip(".")


def torchrun_command(argv: list[str], nproc: int, max_restarts: int = 0) -> list[str]:
    """The torchrun command line that runs `restopo <argv>` on `nproc` local processes."""
    return [sys.executable, "-m", "restopo.train.torchrun", "--standalone",
            f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
            "-m", "restopo", *argv]


STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


def _run_until_stopped(cmd: list[str], env: dict) -> tuple[int, list[str]]:
    """Run torchrun to its end: (exit code, the names of the stop signals this process got,
    none if none) once torchrun and its workers have stopped.

    torchrun runs in a session of its own, so a terminal's Ctrl-C reaches this process
    only; the first stop signal here is passed on as SIGTERM, which torchrun answers by
    stopping its workers (in sessions of their own) and then itself, waiting up to 30 s for
    them to save the step they stop at. A second kills torchrun, and its workers with it (at
    once: their parent-death signal is SIGKILL; a second SIGTERM would have torchrun wait
    for them once more). Meanwhile this process waits, holding the run folder's lock, so no
    second run starts while a worker still writes; torchrun dies with it
    (restopo.worker.die_with_parent) if it is killed outright."""
    import signal

    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    stopped_by: list[str] = []

    def pass_on(signum, frame):
        stopped_by.append(signal.Signals(signum).name)
        if proc.poll() is None:
            if len(stopped_by) == 1:
                proc.send_signal(signal.SIGTERM)
            else:
                proc.kill()

    with signals_handled(STOP_SIGNALS, pass_on):
        code = proc.wait()
    return code, stopped_by


def _after_stop(checkpoints, at_once: bool = False) -> str:
    """Where --resume continues after a stop, and the steps trained since its checkpoint,
    which are lost: the workers save the step they stop at (restopo.train.interrupt) unless
    they are killed first, by a second stop (`at_once`) or by torchrun, 30 s after passing
    the stop on."""
    from .checkpoint import latest_checkpoint, step_of
    from .plots import read_metrics

    last = latest_checkpoint(checkpoints) if checkpoints is not None else None
    said = (f"--resume continues from {last.name}" if last is not None else
            "no checkpoint was saved yet")
    saved = step_of(last) if last is not None else 0
    reached = 0 if checkpoints is None else max(
        (r["step"] for r in read_metrics(checkpoints.parent / "metrics.jsonl")), default=0)
    if reached <= saved:
        return said
    why = ("the second stop ended the workers at once" if at_once else
           "torchrun killed the workers before they had saved the step they stopped at; it "
           "waits 30 s for them")
    return f"{said}; steps {saved + 1}-{reached} are lost ({why})"


def launch(argv: list[str], nproc: int, max_restarts: int = 0, env: dict | None = None,
           checkpoints=None) -> int:
    """Run `restopo <argv>` under torchrun (with `env` added to the environment); its exit
    code, with one clear line on failure (none when rank 0 has said the mistake). The line
    suggests --resume only when `checkpoints` (a run's ckpt/ folder) holds a checkpoint."""
    env = {**os.environ, **(env or {})}
    # torchrun sets 1 thread per worker with a warning when unset; say it ourselves instead
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = torchrun_command(argv, nproc, max_restarts)
    code, stopped_by = _run_until_stopped(cmd, env)
    if stopped_by:
        print(f"restopo train: stopped ({stopped_by[0]}); the workers are stopped; "
              + _after_stop(checkpoints, at_once=len(stopped_by) > 1), file=sys.stderr)
        return 130
    if code == USAGE_EXIT:
        return 1
    if code != 0:
        from .checkpoint import latest_checkpoint

        found = checkpoints is not None and latest_checkpoint(checkpoints) is not None
        print(f"restopo train: error: the {nproc}-process run failed (torchrun exited with "
              f"code {code}): a worker died or raised; which, and why, is said above."
              + (" Re-run with --resume to continue from the last checkpoint." if found
                 else ""), file=sys.stderr)
    return code
