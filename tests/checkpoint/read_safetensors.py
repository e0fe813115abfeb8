"""An independent check of `bulkhead-ckpt export`: reads the exported safetensors
files with json + struct + numpy, reads the checkpoint's HDF5 rank files with
h5py (assembling each tensor from its slices by their attributes), applies
train_moe's Hugging Face names by hand, and compares every tensor's name,
dtype, shape and bytes.

usage: read_safetensors.py EXPORT_FOLDER STEP_FOLDER
"""
import glob
import json
import os
import re
import struct
import sys

import h5py
import numpy as np

DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
          "U8": "u1", "BOOL": "?"}
NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32", "int16": "I16",
         "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def read_export(folder):
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    tensors = {}
    for path in sorted(glob.glob(os.path.join(folder, "model-*.safetensors"))):
        data = open(path, "rb").read()
        (length,) = struct.unpack("<Q", data[:8])
        assert length % 8 == 0, f"{path}: header length {length} leaves the data unaligned"
        header = json.loads(data[8:8 + length])
        assert header["__metadata__"]["format"] == "pt", header["__metadata__"]
        end = 0
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, stop = entry["data_offsets"]
            assert begin == end, f"{path}: '{name}' starts at {begin}, not right after the tensor before it ({end})"
            end = stop
            raw = data[8 + length + begin:8 + length + stop]
            array = np.frombuffer(raw, dtype=DTYPES[entry["dtype"]]).reshape(entry["shape"])
            assert name not in tensors, f"'{name}' appears twice"
            assert index["weight_map"][name] == os.path.basename(path), f"the index puts '{name}' elsewhere"
            tensors[name] = (entry["dtype"], array)
        assert 8 + length + end == len(data), f"{path}: {len(data) - 8 - length - end} bytes past the last tensor"
    assert set(tensors) == set(index["weight_map"]), "the index and the files name different tensors"
    return tensors


def read_checkpoint(step_folder):
    parts = {}
    for path in sorted(glob.glob(os.path.join(step_folder, "rank_*.h5"))):
        with h5py.File(path, "r") as f:
            def visit(name, obj):
                if not isinstance(obj, h5py.Dataset):
                    return
                attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in obj.attrs.items()}
                key = attrs["key"]
                if key.startswith("_bulkhead/") or key.startswith("optim."):
                    return
                parts.setdefault(key, []).append((attrs, obj[()]))
            f.visititems(visit)
    tensors = {}
    for key, slices in parts.items():
        attrs = slices[0][0]
        shape = [int(d) for d in np.atleast_1d(attrs["global_shape"])] if np.size(attrs["global_shape"]) else []
        whole = np.zeros(shape or [1], dtype=slices[0][1].dtype)
        filled = 0
        for a, values in slices:
            offsets = [int(o) for o in np.atleast_1d(a["offsets"])] if np.size(a["offsets"]) else [0]
            region = tuple(slice(o, o + n) for o, n in zip(offsets, values.shape))
            whole[region] = values
            filled += values.size
        assert filled == whole.size, f"{key}: the slices cover {filled} of {whole.size} elements"
        tensors[key] = (attrs["dtype"], whole.reshape(shape))
    return tensors


def hf_names(key, dtype, value):
    """train_moe's key -> (name, dtype, array) in Hugging Face's names, written independently of the map file."""
    m = re.fullmatch(r"layers\.(\d+)\.moe\.experts\.w13", key)
    if m:
        return [(f"model.layers.{m[1]}.mlp.experts.{e}.{proj}.weight", dtype, value[e, p])
                for e in range(value.shape[0]) for p, proj in enumerate(["gate_proj", "up_proj"])]
    m = re.fullmatch(r"layers\.(\d+)\.moe\.experts\.w2", key)
    if m:
        return [(f"model.layers.{m[1]}.mlp.experts.{e}.down_proj.weight", dtype, value[e]) for e in range(value.shape[0])]
    simple = [(r"embed\.weight", "model.embed_tokens.weight"), (r"final_norm\.weight", "model.norm.weight"),
              (r"output\.weight", "lm_head.weight"),
              (r"layers\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
              (r"layers\.(\d+)\.attn\.(q|k|v)\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
              (r"layers\.(\d+)\.attn\.out\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
              (r"layers\.(\d+)\.moe_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
              (r"layers\.(\d+)\.moe\.router\.weight", r"model.layers.\1.mlp.gate.weight"),
              (r"layers\.(\d+)\.moe\.router\.bias", r"model.layers.\1.mlp.gate.e_score_correction_bias")]
    for pattern, name in simple:
        if re.fullmatch(pattern, key):
            return [(re.sub(pattern, name, key), dtype, value)]
    raise AssertionError(f"no Hugging Face name for '{key}'")


def main():
    exported = read_export(sys.argv[1])
    expected = {}
    for key, (dtype, value) in read_checkpoint(sys.argv[2]).items():
        for name, dt, array in hf_names(key, dtype, value):
            expected[name] = (NAMES[dt], np.ascontiguousarray(array))
    assert set(exported) == set(expected), (f"only exported: {sorted(set(exported) - set(expected))[:5]}, "
                                            f"only in the checkpoint: {sorted(set(expected) - set(exported))[:5]}")
    for name, (dtype, array) in expected.items():
        got_dtype, got = exported[name]
        assert got_dtype == dtype, f"{name}: dtype {got_dtype}, the checkpoint has {dtype}"
        assert got.shape == array.shape, f"{name}: shape {got.shape}, the checkpoint has {array.shape}"
        assert got.tobytes() == array.astype(DTYPES[dtype]).tobytes(), f"{name}: the bytes differ"
    print(f"read_safetensors: {len(expected)} tensors match the checkpoint (name, dtype, shape, bytes)")


if __name__ == "__main__":
    main()
