"""The storage a build picks when --weights is not given: the precision of the tensors that become weight
products, not of every tensor the checkpoint holds."""

from __future__ import annotations

import torch
from parcae_checkpoints import write_checkpoint

from speedc.build import default_storage, family_ignored_tensors
from speedc.models.checkpoint.files import declared_tensor_bytes


def test_the_weights_precision_decides_not_small_or_dropped_tensors():
    matrix, norm = (2 * 4096, "BF16"), (4 * 64, "F32")
    assert default_storage({"w": matrix, "norm": norm}) == "bf16"  # a small fp32 norm stays fp32 beside bf16 weights
    assert default_storage({"w": (2 * 4096, "F16"), "norm": norm}) == "fp16"
    buffer = (4 * 4096, "F32")
    assert default_storage({"w": matrix, "freqs_cis": buffer}) == "fp32"  # a large fp32 tensor the family reads
    assert default_storage({"w": matrix, "freqs_cis": buffer}, ignored=("freqs_cis",)) == "bf16"
    assert default_storage({"w": matrix, "lm_head.weight": buffer}) == "fp32"  # an fp32 weight: nothing rounded
    assert default_storage({"w": matrix, "v": (2 * 4096, "F16")}) == "fp32"  # two 16-bit types: neither holds both
    assert default_storage({}) == "fp32"


def test_a_bf16_parcae_checkpoint_with_its_fp32_rotary_buffer_builds_at_bf16(tmp_path):
    """Parcae's checkpoints store bf16 weights beside the fp32 freqs_cis buffer, which the family drops."""
    from safetensors.torch import load_file, save_file

    directory = write_checkpoint(tmp_path / "parcae", seed=0, weights_file="model.safetensors")
    tensors = load_file(str(directory / "model.safetensors"))
    save_file({name: t if name == "freqs_cis" else t.to(torch.bfloat16) for name, t in tensors.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    declared = declared_tensor_bytes(directory)
    assert declared["freqs_cis"][1] == "F32" and declared["freqs_cis"][0] // 4 >= 1024
    assert family_ignored_tensors(directory) == ("freqs_cis",)
    assert default_storage(declared, family_ignored_tensors(directory)) == "bf16"
    assert default_storage(declared) == "fp32"  # what every tensor's precision would have said
    assert family_ignored_tensors(tmp_path) == ()  # no config.json: reading the checkpoint says why, not this
