"""Reading what one run recorded: the scalars of its event files, its ``hparams.yaml``, its seed.

Only regular files are opened (a FIFO or a device named like an event file is skipped, never
read: reading it would wait forever). Event files are read record by record with TensorBoard's
own record reader (``tensorboard.compat.tensorflow_stub``, the one TensorBoard uses without
TensorFlow: it checks both CRCs of every record), so a damaged or cut-short file is read up to
the damage and said once, instead of stopping the report. TensorBoard is imported lazily.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Points = list[tuple[int, float]]
"""The points of one scalar tag: ``(step, value)`` pairs sorted by step, one per step."""

EVENT_FILE_PREFIX = "events.out.tfevents."
HPARAMS_FILE = "hparams.yaml"
"""The file Lightning's ``TensorBoardLogger`` writes the module's and the logger's hyperparameters to."""
MAX_HPARAMS_BYTES = 1 << 20
"""An ``hparams.yaml`` above this size (1 MiB) is not read."""

SEED_IN_PATH = re.compile(r"(?:^|[/_\-.])seed[_\-=]?(\d+)(?=$|[/_\-.])", re.IGNORECASE)
"""A seed in a run's path: ``seed3``, ``seed_3``, ``seed-3``, ``seed=3`` as a folder or inside one
(``runs/tied/seed3/version_0``, ``runs/tied_seed3``); the last one in the path counts."""

D_MODEL_KEYS = ("d_model", "hidden_size", "n_embd", "dim")
"""The names a config gives the width of the embedding's rows (the first found counts)."""
TIE_KEYS = ("tie_weights", "tie_word_embeddings")


def is_regular_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file (after symlinks): never a FIFO, socket, device or directory."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _natural(name: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key: the name's dot-separated parts, numbers by value (``.9`` before ``.10``)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split("."))


def event_files(run_dir: str | os.PathLike[str], notes: list[str] | None = None) -> list[Path]:
    """The regular ``events.out.tfevents.*`` files directly in ``run_dir``, in the order they were written.

    Sorted by name with numbers by value: ``events.out.tfevents.<time>.<host>.<pid>.<n>`` (torch's
    ``SummaryWriter``), so a writer's tenth file comes after its ninth (TensorBoard sorts the names as
    text, ``.10`` before ``.9``).

    Anything else named like an event file (a FIFO, a directory, a broken link) is left out, with a
    note in ``notes`` when given.
    """
    files = []
    try:
        names = sorted(os.listdir(run_dir), key=_natural)
    except OSError as err:
        if notes is not None:
            notes.append(f"{os.fspath(run_dir)}: cannot list the directory ({err.strerror or err})")
        return []
    for name in names:
        if not name.startswith(EVENT_FILE_PREFIX):
            continue
        path = Path(run_dir) / name
        if is_regular_file(path):
            files.append(path)
        elif notes is not None and not path.is_dir():
            notes.append(f"{path}: not a regular file (a FIFO, a device or a broken link), not read")
    return files


def _events(path: Path, notes: list[str] | None) -> Any:
    """The ``Event`` protos of one file, up to the first damaged record (said in ``notes``)."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow

    reader = pywrap_tensorflow.PyRecordReader_New(str(path), 0, None)
    count = 0
    try:
        while True:
            try:
                reader.GetNext()
            except errors.OutOfRangeError:  # the end of the file
                return
            except errors.DataLossError as err:
                if notes is not None:
                    why = ("cut short (a run still writing, or a file cut off)" if "truncated" in str(err)
                           else "damaged (a CRC check failed)")
                    notes.append(f"{path}: {why} after {count} records; read what came before")
                return
            try:
                event = event_pb2.Event.FromString(reader.record())
            except Exception:  # a record whose CRC matched but that is no Event (DecodeError)
                if notes is not None:
                    notes.append(f"{path}: record {count + 1} is not a TensorBoard event; read what came before")
                return
            count += 1
            yield event
    finally:
        handle = getattr(reader, "file_handle", None)
        if handle is not None:
            handle.close()


def read_scalars(run_dir: str | os.PathLike[str], notes: list[str] | None = None) -> dict[str, Points]:
    """Read every scalar tag of the regular event files directly in ``run_dir``.

    Reads classic scalar summaries (``SummaryWriter.add_scalar``) and scalars stored as rank-0
    tensors of the scalars plugin (the TensorFlow 2 writers). The files are read in name order as
    one stream, as TensorBoard's ``EventAccumulator`` reads a directory: when a step was written twice
    (a run resumed from a checkpoint) the last value read wins; a restart marker (``SessionLog.START``)
    drops every point from its step on, and in files older than ``brain.Event:2`` a step that goes
    backwards drops the points of the tags it writes from that step on (``purge_orphaned_data``).

    Args:
        run_dir: the directory holding the event files.
        notes: where to say what could not be read (a file that is not regular, a damaged record);
            None: say nothing.

    Returns:
        Tag -> ``(step, value)`` points sorted by step (tags with no point left out).
    """
    from tensorboard.compat.proto.event_pb2 import SessionLog
    from tensorboard.util import tensor_util

    by_tag: dict[str, dict[int, float]] = {}
    plugin: dict[str, str] = {}
    latest: int | None = None
    version = 0.0  # the stream's file_version: "brain.Event:2" from TensorFlow 1.x on, and every torch writer
    for path in event_files(run_dir, notes):
        for event in _events(path, notes):
            step = int(event.step)
            if event.HasField("file_version"):
                found = re.match(r"brain\.Event:(\d+(?:\.\d+)?)$", event.file_version)
                version = float(found.group(1)) if found else 0.0
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                for series in by_tag.values():  # a restart: everything from its step on is orphaned
                    for s in [s for s in series if s >= step]:
                        del series[s]
            if not event.HasField("summary"):
                continue
            backwards = version < 2 and latest is not None and step < latest
            latest = step
            for value in event.summary.value:
                tag = value.tag
                if value.HasField("metadata") and value.metadata.plugin_data.plugin_name:
                    plugin.setdefault(tag, value.metadata.plugin_data.plugin_name)
                if value.HasField("simple_value"):
                    number = float(value.simple_value)
                elif value.HasField("tensor") and plugin.get(tag) == "scalars":
                    try:
                        array = tensor_util.make_ndarray(value.tensor)
                    except Exception:  # a malformed tensor: not a scalar
                        continue
                    if array.size != 1 or array.dtype.kind not in "fiub":
                        continue
                    number = float(array.reshape(()))
                else:
                    continue
                series = by_tag.setdefault(tag, {})
                if backwards:  # TensorBoard purges this tag's points from the step on
                    for s in [s for s in series if s >= step]:
                        del series[s]
                series[step] = number
    return {tag: sorted(series.items()) for tag, series in by_tag.items() if series}


TRAINER_NAMESPACES = ("train/", "eval/")
"""The namespaces the Hugging Face Trainer's TensorBoard callback puts before every logged key."""


def strip_trainer_namespace(scalars: Mapping[str, Points], prefix: str = "headwatch") -> dict[str, Points]:
    """Read a Hugging Face Trainer run as if it were logged without the Trainer's ``train/`` namespace.

    The Trainer's TensorBoard callback writes ``train/<prefix>/...`` (and ``train/loss``,
    ``eval/loss``). When no tag of the run starts with ``<prefix>/`` but some start with
    ``train/<prefix>/``, those are renamed to ``<prefix>/...`` so that display, grouping and the
    alert markers work as for a Lightning run; every other tag (``train/loss``, ``eval/loss``,
    ``eval/<prefix>/...``) is kept as written. A run that already has ``<prefix>/`` tags is
    returned unchanged (a copy).

    Returns:
        Tag -> points, with the ``train/<prefix>/`` tags renamed.
    """
    head = prefix + "/"
    if any(tag.startswith(head) for tag in scalars):
        return dict(scalars)
    trainer_head = "train/" + head
    return {(tag[len("train/") :] if tag.startswith(trainer_head) else tag): points for tag, points in scalars.items()}


def read_run(run_dir: str | os.PathLike[str], prefix: str = "headwatch", notes: list[str] | None = None) -> dict[str, Points]:
    """:func:`read_scalars` then :func:`strip_trainer_namespace`: a Lightning or a Hugging Face Trainer run alike."""
    return strip_trainer_namespace(read_scalars(run_dir, notes), prefix)


# --------------------------------------------------------------------------- hparams.yaml and seeds


def read_hparams(run_dir: str | os.PathLike[str], notes: list[str] | None = None) -> dict[str, Any] | None:
    """The mapping in ``run_dir/hparams.yaml`` (Lightning's ``TensorBoardLogger``), or None.

    Read with ``yaml.safe_load`` (PyYAML comes with Lightning); None when the file is absent, not a
    regular file, above :data:`MAX_HPARAMS_BYTES`, not YAML or not a mapping (said in ``notes`` then).
    """
    path = Path(run_dir) / HPARAMS_FILE
    if not os.path.lexists(path):
        return None
    problem = None
    data: Any = None
    if not is_regular_file(path):
        problem = "not a regular file"
    elif os.path.getsize(path) > MAX_HPARAMS_BYTES:
        problem = f"larger than {MAX_HPARAMS_BYTES} bytes"
    else:
        try:
            import yaml

            data = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace"))
        except ImportError:
            problem = "PyYAML is not installed"
        except Exception as err:  # yaml.YAMLError, a Python object tag safe_load refuses, OSError
            problem = f"not readable YAML ({type(err).__name__})"
    if problem is None and not isinstance(data, dict):
        problem = "not a mapping"
    if problem is not None:
        if notes is not None:
            notes.append(f"{path}: {problem}; its seed and shapes are not used")
        return None
    return data


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value == int(value)):
        return None
    return int(value)


def run_seed(run_path: str | os.PathLike[str], hparams: Mapping[str, Any] | None = None) -> int | None:
    """The seed of a run: ``seed`` at the top of its ``hparams.yaml``, else the last ``seed<N>`` in its path.

    Args:
        run_path: the run directory as found (``runs/tied/seed3/version_0``).
        hparams: its :func:`read_hparams`.

    Returns:
        The seed, or None when the run records none.
    """
    if hparams is not None:
        seed = _int(hparams.get("seed"))
        if seed is not None:
            return seed
    found = SEED_IN_PATH.findall(Path(run_path).as_posix())
    return int(found[-1]) if found else None


def _find_key(data: Any, keys: Sequence[str], depth: int = 0) -> Any:
    """The value of the first of ``keys`` in a nested mapping (breadth first, at most 4 levels)."""
    if not isinstance(data, Mapping) or depth > 4:
        return None
    for key in keys:
        if key in data:
            return data[key]
    for value in data.values():
        found = _find_key(value, keys, depth + 1)
        if found is not None:
            return found
    return None


def model_shapes(hparams: Mapping[str, Any] | None) -> dict[str, Any]:
    """``{"vocab_size": V, "d_model": d, "tied": bool}``, the keys a run's ``hparams.yaml`` gives.

    ``vocab_size``; ``d_model`` from the first of :data:`D_MODEL_KEYS`; ``tied`` from
    :data:`TIE_KEYS`; searched in nested mappings too (a module's ``config``). Missing keys are left out.
    """
    out: dict[str, Any] = {}
    vocab = _int(_find_key(hparams, ("vocab_size",)))
    width = _int(_find_key(hparams, D_MODEL_KEYS))
    tied = _find_key(hparams, TIE_KEYS)
    if vocab is not None and vocab > 0:
        out["vocab_size"] = vocab
    if width is not None and width > 0:
        out["d_model"] = width
    if isinstance(tied, bool):
        out["tied"] = tied
    return out


def published_shapes(scalars: Mapping[str, Any], prefix: str = "headwatch") -> dict[str, Any]:
    """``{"vocab_size": V, "d_model": d}`` from the run's own ``<prefix>/model/vocab_size`` and
    ``<prefix>/model/hidden_size`` (published by the gradient statistics on every logging step); keys left out
    when absent, and a value that is not a whole count below 2**53 (NaN, inf, 1e300, 2.5: a damaged file) is
    left out."""
    out: dict[str, Any] = {}
    for key, name in (("vocab_size", "vocab_size"), ("d_model", "hidden_size")):
        points = scalars.get(f"{prefix}/model/{name}") or ()
        values = [v for _, v in points if isinstance(v, (int, float)) and 0 < v < 2**53 and float(v).is_integer()]
        if values:
            out[key] = int(values[-1])
    return out
