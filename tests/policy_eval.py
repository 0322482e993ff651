"""What the opt-in learning tests of several policies share: the CLI in a subprocess, a run's latest checkpoint,
and each policy's held-out score against a fixed partner (issue 40).

The score of a policy is measured by the same ``agentrl eval`` command before and after training: one engine serves
every policy's adapter by name (``--lora-paths``), the policy's seat names its adapter (``--role-policy``), and
every other seat plays on a second engine serving the warm start alone (``--role-engine-url``): the fixed partner.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def agentrl_cli(*args: str) -> None:
    """``python -m agentrl ARGS``; a failure shows the end of its stderr."""
    out = subprocess.run([sys.executable, "-m", "agentrl", *args], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]


def latest(run: Path) -> Path:
    """The newest ``iter_N`` folder a run with ``--save`` wrote."""
    return run / f"iter_{int((run / 'latest_checkpointed_iteration.txt').read_text()):07d}"


def seat_scores(
    env: str,
    warm_start: Path,
    adapters: Path,
    seats: dict[str, str],
    held: Path,
    out_dir: Path,
    tag: str,
    turns: list[str],
) -> dict[str, float]:
    """``pass@1`` on ``held`` of each seat (a role of ``env``) played by its policy (``seats``: role -> policy, the
    adapter ``ADAPTERS/adapters/POLICY``, as a run's ``iter_N`` holds it) while every other seat plays the warm start on an engine of its own."""
    from agentrl.engines.local.process import local_server
    from agentrl.trainer.lora import POLICIES_DIR

    paths = [f"{p}={adapters / POLICIES_DIR / p}" for p in seats.values()]
    out: dict[str, float] = {}
    with (
        local_server(warm_start, log_path=out_dir / f"{tag}-fixed.log", extra_args=["--seed", "0"]) as fixed,
        local_server(
            warm_start, log_path=out_dir / f"{tag}-policies.log", extra_args=["--seed", "0", "--lora-paths", *paths]
        ) as served,
    ):
        for seat, policy in seats.items():
            partners = [arg for other in seats if other != seat for arg in ("--role-engine-url", f"{other}={fixed}")]
            result = out_dir / f"{tag}-{seat}.json"
            agentrl_cli("eval", "--env", env, "--hf-checkpoint", str(warm_start), "--engine-url", served,
                        "--role-policy", f"{seat}={policy}", *partners, "--eval-prompt-data", "held", str(held),
                        "--rollout-seed", "90001", "--output", str(result), *turns)  # fmt: skip
            out[seat] = json.loads(result.read_text())["held"]["pass@1"]
    return out
