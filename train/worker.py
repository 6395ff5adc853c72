"""One training rank. Started by torchrun or the DeepSpeed launcher: `python -m dstool.train.worker RUN.json`.

Reads top to bottom: the rank's log -> the process group (watched, elastic restarts counted) -> the checkpoint to
resume from -> the Trainer (trainer.py) runs -> the group is left. Any failure becomes failure.json.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dstool import log as dlog
from dstool.files import write_json_atomic
from dstool.proc import die_with_parent
from dstool.train import autobatch, checkpoint, preempt, watchdog
from dstool.train.config import TrainConfig


def main(run_file: str) -> None:
    die_with_parent(signal.SIGKILL)  # the launcher died: stop too rather than train on alone
    run = json.loads(Path(run_file).read_text())
    cfg = TrainConfig(**run["config"])
    ds_config = run["ds_config"]
    out = Path(cfg.output)
    os.environ.update(cfg.env)  # NCCL_* etc. must be set before the communicator is created
    dlog.setup()  # this rank's own voice: dstool's lines on the console, the libraries' in its log file
    dlog.to_file(out / "logs" / f"rank{os.environ.get('RANK', '0')}.log")
    dlog.prints_to_log()  # and what they print ("stage=1 layers=3") too

    # DeepSpeed and transformers (through the trainer) once the log is set up: what they say on import goes there
    import deepspeed  # noqa: PLC0415 (after the log is set up: what they print on import goes to this rank's log)
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415 (after the log is set up: what they print on import goes to this rank's log)

    from dstool.train.trainer import Trainer  # noqa: PLC0415 (after the log is set up: what they print on import goes to this rank's log)

    dlog.adopt_libraries()
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        # the first init_distributed() JIT-builds deepspeed_shm_comm (over a minute here), an op that serves only
        # inference all-reduce; training all-reduces go through gloo
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    restarts = _init_process_group(accelerator.communication_backend_name(), cfg)  # elastic restarts so far
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())  # adopts the group above
    rank, world = dist.get_rank(), dist.get_world_size()
    gate = preempt.StepGate(out, cfg.save_every_minutes, clock_rank=rank == 0)  # a signal from here on is kept
    if rank != 0 or not run.get("console", True):
        dlog.quiet_console()  # one rank speaks; inside `dstool pipeline` even it keeps to its log file
    torch.manual_seed(cfg.seed)
    resume, universal = _resume_source(run, out, world, restarts, checkpoint.expert_parallel_size(ds_config))
    if universal:  # saved on another world size: DeepSpeed re-partitions the universal form
        ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
    if run.get("micro_batch_search"):  # --micro-batch-size auto on GPUs: the largest that fits, same on every rank
        micro = autobatch.search(run["micro_batch_search"], lambda m: Trainer.fits(cfg, ds_config, m))
        ds_config = autobatch.with_micro(ds_config, micro)
        torch.manual_seed(cfg.seed)
        if rank == 0:
            dlog.log.info(f"dstool: micro batch {micro} per rank fits ({ds_config['gradient_accumulation_steps']} "
                          f"accumulation steps for the global batch of {ds_config['train_batch_size']})")
    Trainer(run, cfg, ds_config, gate, resume, restarts).run()
    dist.barrier()
    dist.destroy_process_group()


def _init_process_group(backend: str, cfg: TrainConfig) -> int:
    """The process group, its nodes watched for silence (train/watchdog.py); returns the elastic restarts so far,
    the same number on every rank. Under torchrun the ranks of a node share its agent's store, which outlives a
    restart (a restarted rank could read a dead rank's gloo address from it and hang), so each attempt gets its own
    key prefix. Agents on several nodes count restarts each their own way (a node restarted only because another
    one's rank died counts none), so dstool's multi-node elastic runs take a fresh store from every rendezvous round
    instead (launch.py), and the ranks agree on the highest count."""
    env = os.environ
    rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    prefix = f"dstool/attempt-{restarts}" if agent_store else "dstool"
    watch = watchdog.Watch(Path(cfg.output), cfg.comm_timeout_s, prefix,
                           elastic=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0)
    try:
        if agent_store:
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False)
            dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world)
        else:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    except RuntimeError as e:
        if "[127." in str(e) and not env.get("GLOO_SOCKET_IFNAME"):  # gloo took a rank's address from its hostname
            raise RuntimeError(f"a rank advertised a loopback address to host {socket.gethostname()} (a host name "
                               "resolves to 127.0.1.1 in /etc/hosts, Debian's default): set GLOO_SOCKET_IFNAME to "
                               "the cluster interface, e.g. --env GLOO_SOCKET_IFNAME=eth0 ('dstool doctor --hostfile' "
                               f"names it); gloo said: {e}") from e
        raise
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ranks: list = [None] * world  # (host name, restarts) of every rank, in one collective
    dist.all_gather_object(ranks, (socket.gethostname(), restarts))
    watch.joined([host for host, _ in ranks])
    return max(count for _, count in ranks)


def _resume_source(run: dict, out: Path, world: int, restarts: int,
                   expert_parallel: int | None) -> tuple[Path | None, bool]:
    """(checkpoint folder to load, whether universal), the same on every rank: the run plan's choice, or after an
    elastic restart the newest checkpoint that passes its manifest check, which rank 0 picks and broadcasts (nodes
    that look at the shared folder moments apart, mid-save, would pick different ones)."""
    tag = Path(run["resume"]) if run["resume"] else None
    if restarts:
        chosen = [str(checkpoint.find_resume(out / "checkpoints") or tag or "") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        tag = Path(chosen[0]) if chosen[0] else None
    return checkpoint.load_source(tag, world, expert_parallel) if tag else (None, False)


OUT_OF_MEMORY_FIX = ("lower --micro-batch-size (the global batch is kept with --global-batch-size), add "
                     "--activation-checkpointing, or offload (--offload-optimizer; --zero 3 --offload-params)")


def failure_message(e: Exception, rank: str) -> str:
    """One line for failure.json: an out-of-memory error named with its fixes, anything else as it is."""
    if autobatch.is_out_of_memory(e):
        said = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"rank {rank} ran out of device memory ({said[:160]}): {OUT_OF_MEMORY_FIX}"
    return f"rank {rank}: {type(e).__name__}: {e}"


def _run(run_file: str) -> None:
    """`main`, and any failure it meets becomes failure.json (the launching `dstool train` reports it in one line)
    plus the traceback in this rank's log. Then the process ends without the interpreter's teardown: its final
    garbage collection over the engine's objects measured 15-20 s per rank here, after everything was written."""
    code = 0
    try:
        main(run_file)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:  # noqa: BLE001
        logging.getLogger("traceback").error("rank failed", exc_info=True)
        out = Path(json.loads(Path(run_file).read_text())["config"]["output"])
        rank = os.environ.get("RANK", "?")
        if not (out / "failure.json").exists():
            write_json_atomic(out / "failure.json", {"message": failure_message(e, rank)})
        code = 1
    logging.shutdown()
    dlog.console_stream().flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _run(sys.argv[1])
