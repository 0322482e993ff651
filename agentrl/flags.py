"""Flags and config files, built from the config dataclasses' fields (:mod:`agentrl.config`).

Every field of ``RolloutConfig``, ``TrainConfig`` and ``RunConfig`` is a flag named after it
(``rollout_batch_size`` -> ``--rollout-batch-size``) with the help and choices in its metadata:
``train``/``sft`` take all of them, ``rollout``/``eval``/``check-env`` the ones that apply
(:func:`add_field_flags`), so no subcommand declares a config flag by hand and none can drift. A
YAML/TOML file given with ``--config`` holds the same keys (dashes or underscores); flags given on
the command line win. Flags a field does not back (``--num-tasks``, ``--output``) are the
subcommand's own, in :mod:`agentrl.cli`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from agentrl.config import RolloutConfig, RunConfig, TrainConfig

FLAG_ALIASES = {"async_mode": ["--async"], "train_backend": ["--backend"]}
PASSTHROUGH_FIELDS = ("sglang_args", "megatron_args")  # filled from unknown flags, see parse_passthrough_flags
CONFIG_CLASSES = (RunConfig, RolloutConfig, TrainConfig)


@contextlib.contextmanager
def naming_flag(flag: str, value: Any) -> Iterator[None]:
    """Re-raise what loading a flag's value raises (a missing module or file, a bad row) as one
    ``ValueError`` that starts with the flag and its value, so the user knows which one to fix."""
    try:
        yield
    except (ValueError, OSError, ImportError, AttributeError, TypeError, KeyError) as exc:
        raise ValueError(f"{flag} {value}: {exc}") from exc


def flag_fields() -> dict[str, dataclasses.Field]:
    """Every config field that is a flag, by name (run fields first, then rollout, then train)."""
    return {f.name: f for cls in CONFIG_CLASSES for f in dataclasses.fields(cls) if f.metadata.get("flag", False)}


FLAG_HELP: dict[str, str] = {name: f.metadata["help"] for name, f in flag_fields().items()}
"""Each flag's help text, by field name (the same text in every subcommand)."""


def _flag_type(annotation: str) -> tuple[str, Any]:
    a = annotation.replace(" ", "")
    base = a.replace("|None", "")
    if base == "bool":
        return "bool", None
    if base.startswith("list[tuple"):
        return "pairs", str
    if base.startswith("list["):
        return "list", {"str": str, "int": int, "float": float}[base[5:-1]]
    return "scalar", {"str": str, "int": int, "float": float}[base]


def _field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def add_field_flags(
    parser: argparse.ArgumentParser,
    names: Iterable[str] | None = None,
    *,
    defaults: bool = True,
    **overrides: dict[str, Any],
) -> None:
    """Add the flags of the config fields ``names`` (None: all of them) to ``parser``.

    ``defaults=True`` gives each flag its field's default (``rollout``/``eval``, which build a
    ``RolloutConfig`` from the namespace); ``False`` leaves them None, so that ``train`` can tell an
    unset flag from one given and fall back to the ``--config`` file, then the dataclass.
    ``overrides``: extra ``add_argument`` keywords by field name (``eval_prompt_data={"required": True}``).
    """
    fields = flag_fields()
    for name in fields if names is None else names:
        f = fields[name]
        kind, typ = _flag_type(str(f.type))
        flags = ["--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, [])]
        kw: dict[str, Any] = {
            "dest": f.name,
            "default": _field_default(f) if defaults else None,
            "help": f.metadata["help"],
        }
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        kw.update(overrides.get(name, {}))
        if kind == "bool":
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif kind == "pairs":
            parser.add_argument(*flags, nargs=2, action="append", metavar=("NAME", "PATH"), **kw)
        elif kind == "list":
            parser.add_argument(*flags, type=typ, action="append", **kw)
        else:
            parser.add_argument(*flags, type=typ, **kw)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Every config field as a flag, defaults None (unset flags fall back to the file, then the dataclass)."""
    add_field_flags(parser, defaults=False)


ROLLOUT_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutConfig))


def rollout_config_from_args(args: argparse.Namespace) -> RolloutConfig:
    """The :class:`RolloutConfig` of a namespace holding every rollout field (``add_field_flags(p, ROLLOUT_FIELDS)``)."""
    return RolloutConfig(**{name: getattr(args, name) for name in ROLLOUT_FIELDS})


def parse_passthrough_flags(rest: list[str]) -> dict[str, dict[str, Any]]:
    """Split the flags argparse did not know into SGLang server flags and Megatron flags.

    As in slime, ``--sglang-mem-fraction-static 0.8`` goes to every SGLang server as
    ``--mem-fraction-static 0.8``. Any other ``--some-flag [value]`` is a Megatron flag, i.e. a
    megatron-core ``TransformerConfig`` field (``--recompute-granularity full``); the run refuses
    names megatron does not know (:meth:`RunConfig.validate`). A flag without a value is ``True``;
    values are read as int, float, ``true``/``false`` or else kept as text; a repeated flag or one
    with several values becomes a list. Returns ``{"sglang_args": {...}, "megatron_args": {...}}``
    (names with underscores, the prefix removed).
    """
    out: dict[str, dict[str, Any]] = {"sglang_args": {}, "megatron_args": {}}
    i = 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--") or token == "--":
            raise ValueError(f"unexpected argument {token!r}: flags look like --name value")
        name, _, inline = token[2:].partition("=")
        values: list[Any] = [inline] if inline else []
        i += 1
        while not inline and i < len(rest) and not (rest[i].startswith("--") and len(rest[i]) > 2):
            values.append(rest[i])
            i += 1
        parsed = [parse_literal(v) for v in values]
        value: Any = True if not parsed else parsed[0] if len(parsed) == 1 else parsed
        key = name.replace("-", "_")
        section = "sglang_args" if key.startswith("sglang_") else "megatron_args"
        key = key[len("sglang_") :] if section == "sglang_args" else key
        if not key:
            raise ValueError(f"bad flag {token!r}")
        if key in out[section]:
            prev = out[section][key]
            value = (prev if isinstance(prev, list) else [prev]) + (value if isinstance(value, list) else [value])
        out[section][key] = value
    return out


def parse_literal(text: str) -> Any:
    """A flag's text as the value it spells: a bool, an int, a float, else the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (.yaml/.yml) or TOML (.toml) file of flag values; unknown keys are refused."""
    p = Path(path)
    if p.suffix == ".toml":
        import tomllib

        data = tomllib.loads(p.read_text())
    elif p.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(p.read_text()) or {}
    else:
        raise ValueError(f"--config {path}: expected a .yaml, .yml or .toml file")
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if k in ("rollout", "train") and isinstance(v, dict):
            flat.update({kk.replace("-", "_"): vv for kk, vv in v.items()})
        else:
            flat[k.replace("-", "_")] = v
    known = {f.name for cls in CONFIG_CLASSES for f in dataclasses.fields(cls)}
    if "backend" in flat:  # the old name of train_backend, as the --backend alias
        flat.setdefault("train_backend", flat.pop("backend"))
    flat["sglang_args"] = dict(flat.get("sglang_args") or {})  # `sglang_args:` left empty in YAML is None
    for k in [k for k in flat if k.startswith("sglang_") and k not in known]:  # sglang_mem_fraction_static: 0.8
        flat["sglang_args"][k[len("sglang_") :]] = flat.pop(k)
    unknown = sorted(set(flat) - known)
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {unknown}; keys are the flag names, e.g. rollout_batch_size")
    if "eval_prompt_data" in flat and isinstance(flat["eval_prompt_data"], dict):
        flat["eval_prompt_data"] = [[k, v] for k, v in flat["eval_prompt_data"].items()]
    return flat


def run_config_from_values(values: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from flat ``field -> value`` (None = default).

    One rule only the flags can see is checked here: ``--num-epoch`` and ``--num-rollout`` both given (refused; in
    a resolved configuration both are set, the length derived from the epochs). Every derived value is the
    preflight's."""
    parts: dict[type, dict[str, Any]] = {RunConfig: {}, RolloutConfig: {}, TrainConfig: {}}
    for cls in parts:
        for f in dataclasses.fields(cls):
            if f.name not in ("rollout", "train") and values.get(f.name) is not None:
                v = values[f.name]
                parts[cls][f.name] = [tuple(x) for x in v] if f.name == "eval_prompt_data" else v
    cfg = RunConfig(
        rollout=RolloutConfig(**parts[RolloutConfig]), train=TrainConfig(**parts[TrainConfig]), **parts[RunConfig]
    )
    if values.get("num_epoch") is not None and values.get("num_rollout") is not None:
        raise ValueError("bad configuration: --num-epoch and --num-rollout both set the run's length; pass one")
    return cfg
