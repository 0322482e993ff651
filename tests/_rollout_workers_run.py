"""A run with rollout workers on a real multi-node Ray cluster (three raylets on this machine); used by
tests/test_rollout_workers.py in a child process (the test session's own Ray is a one-node local cluster).

    python tests/_rollout_workers_run.py CHECKPOINT OUT_DIR [--sandbox docker|process]

The head node (2 CPUs) holds the engine and the trainer; two more nodes (1 CPU and one
``rollout_host`` each) hold one rollout worker each. :class:`WhereEnv` writes where each episode
step ran (Ray node, pid) to ``OUT_DIR/steps.jsonl``; with ``--sandbox`` each step runs a command in
a sandbox of that backend (for docker it records the container's labels); then the first step on a worker
SIGKILLs that worker with its sandbox still open (a worker dying mid-group), and the next step on
another worker blocks its event loop for 10 minutes (a hung worker; --rollout-worker-timeout is 5 s). Prints one JSON line:
the run's summary, the workers' nodes and the cluster's node ids.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import agentrl

ROOT = Path(__file__).resolve().parents[1]


def _claim(path: Path, rec: dict) -> bool:
    """Create ``path`` holding ``rec`` unless it exists (one process wins, whichever node it is on)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rec))  # complete before it appears under its name: a reader never sees it half-written
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    return True


class WhereEnv(agentrl.Env):
    """Two turns; each step records where it ran; reward: the fraction of digits in the reply."""

    async def reset(self, *, seed=None, options=None):
        self.opts = dict(options or {})
        self.turn = 0
        return [{"role": "user", "content": self.opts["prompt"]}], {}

    async def step(self, action: agentrl.Action):
        import ray

        self.turn += 1
        out = Path(self.opts["out"])
        rec: dict = {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "turn": self.turn}
        if self.opts.get("sandbox"):
            from agentrl.sandbox import create_sandbox
            from agentrl.sandbox import docker as docker_backend

            # only the run's pinned reap may remove a dead worker's containers (the test counts them): this
            # worker skips the reaper every process runs before its first container
            docker_backend._reaped_for.add(os.getpid())
            sb = await create_sandbox()  # on --sandbox's backend, in this process (a worker: on its node)
            result = await sb.run("echo hi")
            rec["stdout"] = result.stdout.strip()
            if hasattr(sb, "container"):  # docker
                rec["container"] = sb.container.id
                rec["labels"] = dict(sb.container.labels)
            if os.getpid() != int(self.opts["driver_pid"]):
                if _claim(out / "killed.json", rec):  # the first worker step: die, sandbox open, group in flight
                    os.kill(os.getpid(), signal.SIGKILL)
                killed = json.loads((out / "killed.json").read_text())["pid"]
                if os.getpid() != killed and _claim(out / "hung.json", rec):  # then another worker hangs
                    time.sleep(600)  # blocks the worker's event loop: its health checks go unanswered
            await sb.close()
        with open(out / "steps.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        await asyncio.sleep(0.05)
        text = action.text
        score = sum(c.isdigit() for c in text) / max(len(text), 1)
        done = self.turn >= 2
        return ([] if done else [{"role": "user", "content": "Again, with digits."}]), score / 2, done, False, {}


def main() -> None:
    # Ray on Linux puts its own traffic on the host's interface address, turning 127.0.0.1 into it; with
    # this it stays on loopback (the nodes and every process they start inherit it)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster

    from agentrl.config import RolloutConfig, RunConfig, TrainConfig
    from agentrl.runtime.train import train

    ckpt, out = sys.argv[1], Path(sys.argv[2])
    sandbox = sys.argv[sys.argv.index("--sandbox") + 1] if "--sandbox" in sys.argv else None
    out.mkdir(parents=True, exist_ok=True)
    tasks = out / "tasks.jsonl"
    with open(tasks, "w") as f:
        for i in range(8):
            row = {"prompt": f"Count to {i + 3}.", "out": str(out), "sandbox": sandbox}
            row["driver_pid"] = os.getpid()
            f.write(json.dumps(row) + "\n")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "node_ip_address": "127.0.0.1"},
    )
    for _ in range(2):  # every node on loopback: nothing leaves this machine
        cluster.add_node(num_cpus=1, resources={"rollout_host": 1}, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    try:
        cfg = RunConfig(
            env=f"{Path(__file__).resolve()}:WhereEnv",
            prompt_data=str(tasks),
            hf_checkpoint=ckpt,
            num_rollout=2,
            rollout_batch_size=4,
            save=str(out / "run"),
            ray_address=cluster.address,
            rollout_num_workers=2,
            rollout_worker_cpus=1,
            rollout_worker_resources=["rollout_host=1"],
            rollout_worker_timeout=5 if sandbox else 60,
            rollout=RolloutConfig(
                n_samples_per_prompt=2, max_turns=2, rollout_max_turn_len=8, rollout_seed=3, sandbox=sandbox or "auto"
            ),
            train=TrainConfig(lr=1e-3, global_batch_size=8, seed=3),
        )
        summary = train(cfg)
        import ray

        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        print(json.dumps({"summary": summary, "nodes": nodes}, default=str), flush=True)
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
