"""The converter CLI: HF -> Megatron dist checkpoint -> HF at another layout is bit-exact; bad
input fails with exit code 2, one line naming the tensor or file, and no output left behind."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.background]


def _convert_process(*args, timeout=300):
    """The CLI as users run it, a process of its own (~10 s of interpreter and imports here)."""
    cmd = [sys.executable, "-m", "dapo_megatron.convert", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def cli_here(main, *args) -> subprocess.CompletedProcess:
    """A CLI's `main(argv)` in this process, its stdout / stderr captured: the ranks fork from
    this session's warm forkserver instead of a new interpreter's. Worker tracebacks come back in
    the error (`WorkerError.details`), so what the user sees is what main prints."""
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _convert(*args):
    from dapo_megatron.convert import main
    return cli_here(main, *args)


def _error_line(proc) -> str:
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def _assert_nothing_left(out):
    assert not os.path.exists(out)
    assert not [f for f in os.listdir(os.path.dirname(out)) if ".tmp-" in f]


def _same_tensors(a_dir, b_dir):
    from dapo_megatron.weights import HFCheckpoint
    a, b = HFCheckpoint(a_dir), HFCheckpoint(b_dir)
    assert a.keys() == b.keys()
    for k in a.keys():
        x, y = a.read(k), b.read(k)
        assert x.dtype == y.dtype and torch.equal(x, y), k


@pytest.fixture(scope="module")
def saved(tiny_hf_models, tmp_path_factory):
    """hf-to-mcore of two models at two layouts, shared by the tests below."""
    out = {}
    for model, layout in (("moe", ["--tp", 2, "--ep", 2]), ("qwen2_tied", ["--pp", 2])):
        ckpt = tmp_path_factory.mktemp(model) / "mcore"
        convert = _convert_process if model == "moe" else _convert  # one real process start
        proc = convert("hf-to-mcore", "--hf-dir", tiny_hf_models[model], "--out", ckpt, *layout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        if convert is _convert_process:  # the console is ours: library warnings in a log beside --out
            assert proc.stderr == "" and proc.stdout.splitlines()[-1] == f"wrote {ckpt}", proc.stderr[-3000:]
            assert os.path.getsize(f"{ckpt}.convert.log") > 0
        out[model] = ckpt
    return out


@pytest.mark.parametrize("model,load", [("moe", ["--pp", 2]), ("qwen2_tied", ["--tp", 2])])
def test_round_trip_through_dist_checkpoint(tmp_path, tiny_hf_models, saved, model, load):
    hf, ckpt, back = tiny_hf_models[model], saved[model], tmp_path / "hf_back"
    assert (ckpt / "hf" / "config.json").exists() and (ckpt / "metadata.json").exists()
    assert ".metadata" in json.loads((ckpt / "checksums.json").read_text())["crc32"]
    again = _convert("hf-to-mcore", "--hf-dir", hf, "--out", ckpt)  # refuses to overwrite
    assert again.returncode == 2 and "--force" in _error_line(again)
    proc = _convert("mcore-to-hf", "--ckpt", ckpt, "--out", back, "--shard-mb", 1, *load)
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded output files
    assert (back / "config.json").exists()
    _same_tensors(hf, str(back))
    from checkpoint_tools.inspect import main as inspect_main
    from checkpoint_tools.tables import inspect
    assert "embedding.word_embeddings.weight" in inspect(str(ckpt)) and "checksums.json lists" in inspect(str(ckpt))
    assert inspect_main([str(ckpt), "--check"]) == 0
    assert "model.embed_tokens.weight" in inspect(str(back))


def test_verify_tool_on_a_dist_checkpoint(tiny_hf_models, saved):
    """checkpoint_tools/verify.py: logits of a saved dist checkpoint (TP2xEP2), loaded at EP2."""
    from checkpoint_tools.verify import main
    proc = cli_here(main, "--hf-dir", tiny_hf_models["moe"], "--ckpt", saved["moe"], "--ep", "2", "--tol", "1e-4")
    assert proc.returncode == 0 and "OK: max |logits diff|" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def _rewrite(src, dst, edit):
    """Copy an HF dir, applying `edit(dict of tensors)` to its single safetensors file."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _truncate(src, dst):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 4096)
    return dst


CASES = {
    "missing": (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
                "model.layers.1.mlp.experts.3.up_proj.weight"),
    "extra": (lambda t: t.__setitem__("model.layers.0.mlp.shared_expert.weight", torch.zeros(2)),
              "model.layers.0.mlp.shared_expert.weight"),
    "shape": (lambda t: t.__setitem__("model.layers.2.self_attn.k_proj.weight", torch.zeros(32, 128)),
              "model.layers.2.self_attn.k_proj.weight"),
}


@pytest.mark.parametrize("case", [*CASES, "truncated", "no_dir"])
def test_bad_input_is_one_clear_line(tmp_path, tiny_hf_models, case):
    src = tiny_hf_models["moe"]
    if case == "truncated":
        bad, expect = _truncate(src, tmp_path / "bad"), "model.safetensors"
    elif case == "no_dir":
        bad, expect = tmp_path / "nowhere", "nowhere"
    else:
        edit, expect = CASES[case]
        bad = _rewrite(src, tmp_path / "bad", edit)
    out = tmp_path / "out" / "mcore"
    out.parent.mkdir()
    proc = _convert("hf-to-mcore", "--hf-dir", bad, "--out", out, "--tp", 2)
    assert proc.returncode == 2
    assert expect in _error_line(proc)
    _assert_nothing_left(str(out))


def _flip_a_byte(ckpt):
    path = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    return path.name


def _truncate_without_manifest(ckpt):
    (ckpt / "checksums.json").unlink()  # as written by another tool: the byte ranges are still checked
    path = min(ckpt.glob("*.distcp"))
    os.truncate(path, path.stat().st_size - 100)
    return path.name


def _config(edit):
    def apply(ckpt):
        cfg = json.loads((ckpt / "hf" / "config.json").read_text())
        edit(cfg)
        (ckpt / "hf" / "config.json").write_text(json.dumps(cfg))
    return apply


DAMAGE = {  # what is done to a copy of the TP2xEP2 MoE checkpoint -> words the error line must hold
    "flipped_byte": (_flip_a_byte, ["is damaged", "CRC32"]),
    "truncated_no_manifest": (_truncate_without_manifest, ["truncated"]),
    "config_tied": (_config(lambda c: c.update(tie_word_embeddings=True)), ["output_layer.weight", "no place"]),
    "config_shape": (_config(lambda c: c.update(moe_intermediate_size=c["moe_intermediate_size"] // 2)),
                     ["shape mismatch", "linear_fc1.weight"]),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_or_mismatched_dist_checkpoint_is_one_clear_line(tmp_path, saved, case):
    """mcore-to-hf: a damaged file (checked against checksums.json, or the byte ranges of
    .metadata), a checkpoint tensor the config has no place for (it would be dropped silently), a
    shape the config disagrees with."""
    damage, words = DAMAGE[case]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["moe"], ckpt)
    name = damage(ckpt)
    out = tmp_path / "out" / "hf"
    out.parent.mkdir()
    proc = _convert("mcore-to-hf", "--ckpt", ckpt, "--out", out, "--pp", 2)
    assert proc.returncode == 2
    line = _error_line(proc)
    assert all(w in line for w in words + [name or ""]), line
    _assert_nothing_left(str(out))
