"""``export-lora --overwrite`` replaces only an earlier export-lora: a folder that also holds other LoRA files
or a model subfolder is refused before anything is read or written, naming every foreign file, and nothing
in it is deleted."""

from __future__ import annotations

from dfm.convert.cli import main as convert_main
from dfm.convert.flux import FLUX
from dfm.convert.import_export import lora_folder_problem


def test_export_lora_overwrite_refuses_foreign_files_and_deletes_nothing(tmp_path, capsys):
    """Through convert_flux.py's main (``dfm.convert.cli.main(FLUX)``)."""
    target = tmp_path / "lora"
    files = {
        "pytorch_lora_weights.safetensors": b"an earlier export-lora",
        "other_style_lora.safetensors": b"another LoRA",
        "transformer/diffusion_pytorch_model.safetensors": b"a model",
        "transformer/config.json": b"{}",
    }
    for name, data in files.items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(data)
    argv = ["export-lora", "--checkpoint", str(tmp_path / "no_ckpt"), "--output", str(target), "--overwrite"]
    assert convert_main(FLUX, argv) == 2
    out = capsys.readouterr().out
    assert (
        "holds files export-lora does not write: other_style_lora.safetensors, transformer/config.json, "
        "transformer/diffusion_pytorch_model.safetensors" in out
    ), out
    assert {name: (target / name).read_bytes() for name in files} == files


def test_an_earlier_export_lora_may_be_replaced(tmp_path):
    (tmp_path / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    for sub in ("transformer", "transformer_2"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    assert lora_folder_problem(tmp_path) is None
