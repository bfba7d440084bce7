"""Worker processes (issue 24): ranks 1 .. N-1 of `--tensor-parallel-size T` and / or
`--pipeline-parallel-size P` (N = T x P; rank r is tensor-parallel rank r % T of stage r // T,
each stage's T ranks all-reducing in their own process group).

Rank 0 is the engine's own process: it runs the scheduler, builds each step's batch and, before
its own forward, broadcasts the batch to the workers as plain data (`StepMessage`: token ids,
positions and the attention metadata as tensors and lists, plus the step's block copies) with
`torch.distributed.broadcast_object_list`. Every rank then runs its part of the forward: with
tensor parallelism its shard of every layer, the all-reduces after o_proj and down_proj
(`tensor_parallel.add_all_reduce`) meeting across the ranks; with pipeline parallelism its
range of layers, the states passed on point to point (`pipeline_parallel`). Rank 0 samples;
tensor-parallel workers compute the same logits in the same order (the message carries the
sampling rows and prompt-logprob spans), which a vocab-parallel lm_head all-gathers.

Processes are spawned (fresh interpreters) and meet over gloo on CPU through a TCP store on a
free loopback port; each rank holds only its shard of the weights and its own KV cache, with
the same number of blocks (every rank computes it from the same settings and its share of
the KV heads). A worker that dies is noticed before the next step (`check_alive`) or by the
collective failing; either way the engine raises one line. `close()` (at engine close, or at
exit) sends the stop message, joins the workers and ends the process group.

Ranks on several machines: a launcher (torchrun, or RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT by hand) starts every rank; nothing is spawned then, all join through `env://`,
and a rank > 0 runs the worker loop and ends its process (`launched_rank`). NCCL on CUDA is
not built: the ranks run on CPUs.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from qserve.errors import QServeError

logger = logging.getLogger("qserve")

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # a collective a dead peer never joins


class WorkerDiedError(QServeError):
    """A tensor- or pipeline-parallel worker is gone: the engine cannot run another step."""


@dataclass
class StepMessage:
    """What a worker needs to run one step's forward, as plain data."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: Any  # qserve.model.attention.AttentionMetadata (tensors and int lists)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # the logits rank 0 computes this step, which a vocab-parallel lm_head gathers from every
    # rank: its sampling rows (None: none) and prompt-logprob spans, in the order it runs them
    logits_indices: torch.Tensor | None = None
    prompt_spans: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class WorkerArgs:
    """How a worker builds its rank: the model, its dtype and device, threads, the store."""

    model_path: str
    dtype: torch.dtype
    device: str
    num_threads: int
    port: int | None  # None: the launcher's env:// rendezvous
    tp_size: int = 1  # ranks s * tp_size .. (s + 1) * tp_size - 1 shard stage s's layers
    pp_size: int = 1
    micro_batches: int = 1  # pipeline: micro-batches a step is cut into

    @property
    def world(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def kind(self) -> str:
        """How the ranks split the model, for messages: tensor, pipeline, or both."""
        if self.pp_size == 1:
            return "tensor"
        return "pipeline" if self.tp_size == 1 else "tensor- and pipeline"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, args: WorkerArgs) -> None:
    """Join the gloo group: on a loopback port rank 0 picked, or (port None) through the
    launcher's env:// rendezvous (MASTER_ADDR, MASTER_PORT). With both kinds of parallelism,
    every rank also makes each stage's tensor-parallel group (`_STAGE_GROUPS`)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method="env://" if args.port is None else f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=args.world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    _STAGE_GROUPS.clear()
    if args.tp_size > 1 and args.pp_size > 1:  # every rank makes every group, in one order
        for s in range(args.pp_size):
            ranks = list(range(s * args.tp_size, (s + 1) * args.tp_size))
            _STAGE_GROUPS.append(dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT))


_STAGE_GROUPS: list[Any] = []  # stage s's tensor-parallel process group (TP x PP only)


def launched_rank(args: WorkerArgs) -> int | None:
    """This process's rank when a launcher started every rank (torchrun, or RANK / WORLD_SIZE /
    MASTER_ADDR / MASTER_PORT set by hand, one process per rank, on any machines); None when
    rank 0 is to spawn the others here."""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1")) <= 1:
        return None
    if int(env["WORLD_SIZE"]) != args.world:
        sizes = [f"--{k}-parallel-size {n}" for k, n in
                 (("tensor", args.tp_size), ("pipeline", args.pp_size)) if n > 1]  # fmt: skip
        product = f" = {args.world}" if len(sizes) > 1 else ""
        raise QServeError(
            f"WORLD_SIZE {env['WORLD_SIZE']} (from the launcher) is not {' x '.join(sizes)}"
            f"{product}"
        )
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise QServeError(f"WORLD_SIZE is set but {', '.join(missing)} is not")
    return int(env["RANK"])


def threads_per_rank(num_threads: int | None, world: int) -> int:
    """--num-threads per rank; by default the cores split evenly between the ranks."""
    return num_threads or max(1, (os.cpu_count() or 1) // world)


class Workers:
    """Rank 0's handle on ranks 1 .. world-1 (tensor- or pipeline-parallel)."""

    def __init__(self, args: WorkerArgs) -> None:
        import torch.distributed as dist
        import torch.multiprocessing as mp

        if dist.is_initialized():
            raise QServeError(
                "a parallel engine is already running in this process: close it first"
            )
        self.args = args
        ctx = mp.get_context("spawn")
        ranks = range(1, args.world) if args.port is not None else ()  # else: launched
        self.procs = [
            ctx.Process(target=worker_main, args=(rank, args), daemon=True, name=f"qserve-tp{rank}")
            for rank in ranks
        ]
        for p in self.procs:
            p.start()
        self.closed = False
        atexit.register(self.close)
        init_group(0, args)

    def check_alive(self) -> None:
        """One line naming the first worker that has exited."""
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise WorkerDiedError(
                    f"{self.args.kind}-parallel worker rank {rank} exited (code {p.exitcode}): "
                    "the engine cannot run steps without it"
                )

    def send(self, message: Any) -> None:
        """Broadcast one message (the KV spec, a StepMessage, or None to stop) to the workers."""
        import torch.distributed as dist

        self.check_alive()
        try:
            dist.broadcast_object_list([message], src=0)
        except RuntimeError as exc:  # a peer vanished mid-collective
            raise self.collective_failed(exc) from None

    def collective_failed(self, exc: BaseException) -> WorkerDiedError:
        """The error for a collective that failed: the group is broken for good. Names the
        worker that exited if one did (its death may take a moment to be seen)."""
        for p in self.procs:
            p.join(timeout=1.0 / len(self.procs))
        try:
            self.check_alive()
        except WorkerDiedError as died:
            return died
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return WorkerDiedError(f"a {self.args.kind}-parallel collective failed: {first}")

    def watch(self, on_death: Callable[[str], None], interval: float = 0.5) -> None:
        """Call on_death(one line) once, from a thread, when a worker is found exited (the
        server's way to notice one while idle)."""

        def poll() -> None:
            while not self.closed:
                try:
                    self.check_alive()
                except WorkerDiedError as exc:
                    on_death(str(exc))
                    return
                time.sleep(interval)

        threading.Thread(target=poll, name="qserve-tp-watch", daemon=True).start()

    def close(self) -> None:
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([None], src=0)
        except RuntimeError:
            pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        _STAGE_GROUPS.clear()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_workers(
    config: Any, path: Any, dtype: torch.dtype, model_config: Any
) -> tuple[Workers | None, Any, Any]:
    """For `config.tensor_parallel_size` or `pipeline_parallel_size` N > 1: check that the
    model splits N ways (one line if not, before anything starts), set this process's threads,
    spawn ranks 1 .. N-1 and join the group as rank 0. Returns (workers, rank 0's TPRank or
    None, its PPRank or None); (None, None, None) for one process."""
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    if tp_size == pp_size == 1:
        return None, None, None
    if not config.device.startswith("cpu"):
        raise QServeError("tensor and pipeline parallelism run on CPU (gloo) so far, not on CUDA")
    micro_batches = config.pipeline_micro_batches or pp_size
    args = WorkerArgs(str(path), dtype, config.device, 1, None, tp_size, pp_size, micro_batches)
    for tp, pp in (parallel_rank(args, r, model_config) for r in (0, args.world - 1)):
        for part in (tp, pp):  # refuse what does not split (the last stage has the fewest
            if part is not None:  # layers), in one line, before anything starts
                part.rank_config(model_config)
    launched = launched_rank(args)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched is not None else args.world
    threads = threads_per_rank(config.num_threads, local)  # ranks on this machine share it
    torch.set_num_threads(threads)
    port = free_port() if launched is None else None
    args = dataclasses.replace(args, num_threads=threads, port=port)
    if launched:  # a launched rank > 0: serve rank 0's steps, then end the process
        worker_main(launched, args)
        sys.exit(0)
    workers = Workers(args)
    return (workers, *parallel_rank(args, 0, model_config))  # after the groups are made


def parallel_rank(args: WorkerArgs, rank: int, model_config: Any) -> tuple[Any, Any]:
    """(TPRank or None, PPRank or None): what `load_model` takes for global rank `rank`, which
    is tensor-parallel rank rank % tp_size of stage rank // tp_size (vLLM's order)."""
    from qserve.parallel.pipeline_parallel import PPRank
    from qserve.parallel.tensor_parallel import TPRank

    tp_rank, stage = rank % args.tp_size, rank // args.tp_size
    tp = pp = None
    if args.tp_size > 1:
        group = _STAGE_GROUPS[stage] if _STAGE_GROUPS else None
        tp = TPRank(tp_rank, args.tp_size, group)
    if args.pp_size > 1:
        layers = model_config.num_hidden_layers
        pp = PPRank(stage, args.pp_size, layers, args.micro_batches, args.tp_size, tp_rank)
    return tp, pp


def worker_main(rank: int, args: WorkerArgs) -> None:
    """A worker process: build rank `rank`'s model and KV cache, then run each step's forward
    until the stop message. Any error: one line on stderr, exit code 1."""
    try:
        _serve(rank, args)
    except Exception as exc:  # noqa: BLE001 - the one line is the report
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"qserve: {args.kind}-parallel worker rank {rank}: {first}", file=sys.stderr)
        sys.exit(1)


def _serve(rank: int, args: WorkerArgs) -> None:
    import torch.distributed as dist

    from qserve.engine.model_runner import ModelRunner
    from qserve.model.config import ModelConfig
    from qserve.model.loader import load_model

    torch.set_num_threads(args.num_threads)
    init_group(rank, args)
    full_config = ModelConfig.from_pretrained(args.model_path)
    tp, pp = parallel_rank(args, rank, full_config)
    model, config = load_model(args.model_path, args.dtype, args.device, tp=tp, pp=pp)
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)  # rank 0's KV cache spec: the same number of blocks
    kv_spec = dataclasses.replace(box[0], num_layers=config.num_hidden_layers)  # its own layers
    runner = ModelRunner(model, config, kv_spec, args.device)
    while True:
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        runner.run_forward(box[0])
    dist.destroy_process_group()
