"""The disk tier against another local user (issue 26.1): a ``pagedcore-kv`` folder someone else made in a shared
directory is refused at start-up (naming it, its owner and mode); a FIFO or a link under a block's name is a miss,
never a hang; file names do not reveal which prompts were served. The other user is real: ``nobody`` via setpriv."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from models import FIRST_TOKEN, tiny_model

from pagedcore.adapters.transformers import Engine
from pagedcore.block_keys import chain_keys, namespace_bytes
from pagedcore.cli import main
from pagedcore.disk_store import DiskKVStore
from pagedcore.errors import ConfigError
from pagedcore.kv_frame import MAGIC, encode

BS = 4
NOBODY = 65534


def as_nobody(script: str) -> None:
    """Run a shell script as another OS user (``nobody``)."""
    command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c", script]
    subprocess.run(command, check=True, capture_output=True, timeout=60)


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="acting as a second OS user needs root and setpriv (CI runs as root)",
)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may write, as /tmp is (mode 1777)."""
    path = Path(tempfile.mkdtemp(prefix="pagedcore-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def prompt(length: int = 22) -> list[int]:
    g = torch.Generator().manual_seed(11)
    return torch.randint(FIRST_TOKEN, 200, (length,), generator=g).tolist()


def greedy(engine: Engine, tokens: list[int]) -> list[int]:
    (out,) = engine.generate([tokens], max_new_tokens=3, do_sample=False, use_tqdm=False)
    return out.token_ids


def stored_frames(directory: Path) -> list[tuple[dict, bytes]]:
    """(header, payload) of every block a store holds."""
    frames = []
    for path in sorted((directory / "pagedcore-kv").rglob("*.kv")):
        data = path.read_bytes()
        (size,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4
        frames.append((json.loads(data[start : start + size]), data[start + size : -32]))
    return frames


@needs_root
def test_a_store_folder_another_user_made_is_refused_at_start(shared, tmp_path):
    """``nobody`` made ``pagedcore-kv`` (0777) in a shared directory and planted well-framed keys and values (the
    frame is a checksum, not authentication) and a FIFO under block names: the store refuses the folder, naming it,
    its owner and its mode, before anything is read."""
    model = tiny_model("llama")
    tokens = prompt()
    with Engine(model, num_blocks=16, block_size=BS, kv_store=tmp_path, kv_store_bytes="16MiB") as engine:
        expected = greedy(engine, tokens)
    by_key = {header["key"]: (header, payload) for header, payload in stored_frames(tmp_path)}
    chain = chain_keys(next(iter(by_key.values()))[0]["fingerprint"], 0, namespace_bytes(None), tokens + expected, BS)
    assert set(chain) == set(by_key)  # 6 blocks: 22 prompt tokens and 2 generated
    planted = shared / ".planted"  # the attacker's own copies (they know the public model, so the fingerprint)
    planted.mkdir()
    planted.chmod(0o755)
    lines = ["set -e", f"mkdir -m 777 {shared}/pagedcore-kv"]
    for key in chain:
        header, payload = by_key[key]
        (planted / key).write_bytes(encode(key, header["fingerprint"], 0, header["tokens"], bytes(len(payload))))
        (planted / key).chmod(0o644)
        target = f"{shared}/pagedcore-kv/{key[:2]}/{key}.kv"
        lines.append(f"mkdir -p {shared}/pagedcore-kv/{key[:2]}")
        # the prompt's 5 loadable blocks framed with zeros for keys and values, a FIFO under the 6th
        lines.append(f"mkfifo {target}" if key == chain[-1] else f"cp {planted / key} {target}")
    lines.append(f"chmod -R a+rwX {shared}/pagedcore-kv")
    as_nobody("\n".join(lines))
    folder = shared / "pagedcore-kv"
    assert folder.stat().st_uid == NOBODY and stat.S_IMODE(folder.stat().st_mode) == 0o777

    restarted = tiny_model("llama")
    try:
        engine = Engine(restarted, num_blocks=16, block_size=BS, kv_store=shared, kv_store_bytes="16MiB")
    except ConfigError as exc:
        message = str(exc)
    else:
        with engine:
            got = greedy(engine, tokens)
            loaded = engine.stats().kv_store_loaded_tokens
        pytest.fail(f"another user's folder was used: {loaded} planted tokens loaded, {got} (generate: {expected})")
    assert str(folder) in message and "nobody" in message and "0o777" in message


@needs_root
def test_the_command_line_names_the_folder_its_owner_and_mode(shared, capsys):
    as_nobody(f"mkdir -m 777 {shared}/pagedcore-kv")
    code = main(["serve", "--kv-store", str(shared), "--kv-store-bytes", "1MiB", "--num-blocks", "8"])
    err = capsys.readouterr().err
    assert code != 0
    assert f"{shared / 'pagedcore-kv'}" in err and "nobody" in err and "0o777" in err


def test_a_folder_others_may_write_or_a_link_is_refused(tmp_path):
    folder = tmp_path / "pagedcore-kv"
    folder.mkdir()
    folder.chmod(0o777)  # this user's, but anyone could plant files in it
    with pytest.raises(ConfigError, match="0o777"):
        DiskKVStore(tmp_path, 1024)
    folder.chmod(0o755)  # readable by others only: made owner-only
    DiskKVStore(tmp_path, 1024)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    other = tmp_path / "other"
    other.mkdir()
    target = other / "elsewhere"
    target.mkdir(mode=0o700)
    (other / "pagedcore-kv").symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        DiskKVStore(other, 1024)


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_a_fifo_or_link_under_a_block_name_is_a_miss_not_a_hang(tmp_path, kind):
    store = DiskKVStore(tmp_path, 1 << 20)
    key = "ab" * 32
    path = store.path_of(key)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "symlink":
        secret = tmp_path / "not-a-block"
        secret.write_bytes(b"x" * 64)
        path.symlink_to(secret)
    else:
        path.mkdir()
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(store.get(key)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reading a block hung"
    assert result == [None]
    if kind != "directory":
        assert store.stats()["refused_files"] == 1 and not os.path.lexists(path)
    assert not store.contains(key) or kind == "directory"


def test_file_names_do_not_reveal_the_prompts_chain_keys(tmp_path):
    model = tiny_model("llama")
    tokens = prompt(25)
    with Engine(model, num_blocks=16, block_size=BS, kv_store=tmp_path, kv_store_bytes="16MiB") as engine:
        greedy(engine, tokens)
        fingerprint = engine.pool.tiers._io.fingerprint()
    names = {p.stem for p in (tmp_path / "pagedcore-kv").rglob("*.kv")}
    assert len(names) >= 6
    keys = set(chain_keys(fingerprint, 0, namespace_bytes(None), tokens, BS))
    assert not names & keys  # without the store's secret a name cannot be tied to a prompt
    with Engine(tiny_model("llama"), num_blocks=16, block_size=BS, kv_store=tmp_path, kv_store_bytes="16MiB") as again:
        assert greedy(again, tokens) == greedy_reference(model, tokens)
        assert again.stats().kv_store_loaded_tokens == 24  # the secret persists: a restart finds its blocks


def greedy_reference(model, tokens: list[int]) -> list[int]:
    out = model.generate(torch.tensor([tokens]), max_new_tokens=3, do_sample=False)
    return out[0, len(tokens) :].tolist()
