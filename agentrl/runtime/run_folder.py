"""Checkpoint folders of a run: ``<save>/iter_NNNNNNN/`` plus Megatron's tracker file.

``iter_0000005`` holds the state after 5 rollout steps: a Hugging Face model folder (config,
tokenizer, safetensors: ``AutoModelForCausalLM.from_pretrained`` loads it), the trainer's
optimizer/RNG state and ``loop_state.json`` (data cursor, buffer, weight version); a ppo run adds
its critic under ``critic/``. A checkpoint is
written to ``iter_NNNNNNN.tmp`` and renamed when complete, and the tracker
``latest_checkpointed_iteration.txt`` is replaced atomically after that, so a run killed at any
moment (SIGKILL included) resumes from the last complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

TRACKER = "latest_checkpointed_iteration.txt"
CRITIC_DIR = "critic"
"""``iter_NNNNNNN/critic/``: a ppo run's critic (weights, optimizer, RNG), saved and resumed with the actor."""


def iter_dir(save: str | Path, step: int) -> Path:
    return Path(save) / f"iter_{step:07d}"


def latest_checkpoint(load: str | Path) -> Path | None:
    """The newest complete checkpoint under ``load`` (or ``load`` itself if it is one); None if none."""
    root = Path(load)
    if (root / "loop_state.json").exists():
        return root
    tracker = root / TRACKER
    if tracker.exists():
        text = tracker.read_text().strip()
        if not (text.isascii() and text.isdigit()):
            raise ValueError(
                f"{tracker} should hold the newest step number, not {text[:40]!r}: write the step of "
                f"the newest complete iter_* folder into it (or delete it to resume from that folder)"
            )
        step = int(text)
        path = iter_dir(root, step)
        if (path / "loop_state.json").exists():
            return path
    done = sorted(
        p
        for p in root.glob("iter_*")
        if p.is_dir() and not p.name.endswith(".tmp") and (p / "loop_state.json").exists()
    )
    return done[-1] if done else None


def begin(save: str | Path, step: int) -> Path:
    """A fresh temporary folder to write the step's checkpoint into."""
    tmp = Path(save) / f"iter_{step:07d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(save: str | Path, step: int, tmp: Path, loop_state: dict[str, Any], *, keep: int | None = None) -> Path:
    """Write ``loop_state.json`` last, rename the folder into place, update the tracker."""
    (tmp / "loop_state.json").write_text(json.dumps(loop_state, default=str))
    final = iter_dir(save, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    tracker_tmp = Path(save) / (TRACKER + ".tmp")
    tracker_tmp.write_text(str(step))
    os.replace(tracker_tmp, Path(save) / TRACKER)
    if keep:
        old = sorted(p for p in Path(save).glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for p in old[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
    return final


def read_loop_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "loop_state.json").read_text())


def check_critic(path: Path, ppo: bool) -> None:
    """Refuse to resume ``path`` (a checkpoint) with ``--advantage-estimator ppo`` when it holds no critic: the
    critic would silently start from scratch beside a trained actor."""
    if ppo and not (path / CRITIC_DIR).is_dir():
        raise ValueError(
            f"--load: {path} holds no critic ({CRITIC_DIR}/): it was not a ppo run. Resuming it with "
            "--advantage-estimator ppo would start a critic from scratch; start a new run from its weights with "
            "--hf-checkpoint instead"
        )
