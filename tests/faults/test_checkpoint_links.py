"""The checkpoint root is dfm's: nothing is written through a symbolic link, a root holding links that point
outside it is refused at start naming them (files outside untouched), and paths a checkpoint's own files name
(manifest entries, ``.metadata`` storage paths) stay inside the checkpoint folder."""

from __future__ import annotations

import json
from pathlib import Path

from entry import run_entry
from test_checkpoint_files import write_checkpoint

from dfm.checkpoint.__main__ import main as verify_cli
from dfm.checkpoint.files import mark_latest
from dfm.checkpoint.manifest import MANIFEST, write_manifest
from dfm.config.loader import save_config_yaml
from dfm.config.recipes import get_recipe


def victims(tmp_path: Path) -> dict[Path, bytes]:
    outside = tmp_path / "outside"
    outside.mkdir()
    files = {outside / "victim_latest": b"someone else's file\n", outside / "victim_config": b"keep me\n"}
    for path, data in files.items():
        path.write_bytes(data)
    return files


def test_a_root_with_links_pointing_outside_is_refused_naming_them(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    files = victims(tmp_path)
    latest_victim, config_victim = files
    (root / ".latest.tmp").symlink_to(latest_victim)
    (root / "config.yaml").symlink_to(config_victim)
    args = ["train.train_iters=2", f"checkpoint.save={root}", "checkpoint.save_interval=1"]
    result = run_entry(1, [*args, f"logger.log_dir={tmp_path / 'log'}"], timeout=300)
    assert result.returncode != 0
    assert "holds symbolic links pointing outside it" in result.stderr, result.stderr[-3000:]
    assert f"{root / '.latest.tmp'} -> {latest_victim}" in result.stderr
    assert f"{root / 'config.yaml'} -> {config_victim}" in result.stderr
    assert all(path.read_bytes() == data for path, data in files.items())
    assert sorted(p.name for p in root.iterdir()) == [".latest.tmp", "config.yaml"]  # nothing written, no lock


def test_dfm_writes_replace_links_instead_of_writing_through_them(tmp_path):
    """A link planted after start-up (at any name dfm writes) is replaced; the file it pointed at is untouched."""
    root = tmp_path / "ckpt"
    directory = write_checkpoint(root, 2)
    files = victims(tmp_path)
    latest_victim, config_victim = files
    (root / "latest").unlink()
    (root / "latest").symlink_to(latest_victim)
    (root / ".latest.tmp").symlink_to(latest_victim)
    (root / "config.yaml").symlink_to(config_victim)
    (directory / MANIFEST).unlink()
    (directory / MANIFEST).symlink_to(config_victim)
    mark_latest(root, 2)
    save_config_yaml(get_recipe("dit_tiny"), root / "config.yaml")
    write_manifest(directory, [])
    assert all(path.read_bytes() == data for path, data in files.items())
    assert not any(p.is_symlink() for p in (root / "latest", root / "config.yaml", directory / MANIFEST))
    assert (root / "latest").read_text() == "2\n"


def test_verify_keeps_manifest_paths_inside_the_checkpoint(tmp_path, capsys):
    root = tmp_path / "ckpt"
    directory = write_checkpoint(root, 2)
    outside = tmp_path / "secret"
    outside.write_bytes(b"x" * 12345)
    body = json.loads((directory / MANIFEST).read_text())
    body["files"] += [
        {"path": "../../secret", "size": 1, "checksum": "crc32:00000000"},
        {"path": str(outside), "size": 1, "checksum": "crc32:00000000"},
    ]
    (directory / MANIFEST).write_text(json.dumps(body))
    assert verify_cli(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "entry '../../secret' lies outside the checkpoint folder" in out
    assert f"entry '{outside}' lies outside the checkpoint folder" in out
    assert "12345" not in out  # the outside file was not read
