"""What a training checkpoint carries for export (weights/hf_io.copy_hf_files)."""
import json

from dapo_megatron.weights.hf_io import copy_hf_files


def test_model_config_and_tokenizer_from_their_own_folders(tmp_path):
    model, tok, dst = tmp_path / "model", tmp_path / "tok", tmp_path / "ckpt" / "hf"
    model.mkdir()
    tok.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (model / "generation_config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights stay out")
    (tok / "config.json").write_text(json.dumps({"model_type": "other"}))  # a tokenizer repo's own config
    (tok / "tokenizer.json").write_text("{}")
    (tok / "chat_template.jinja").write_text("{{ messages }}")
    copy_hf_files(str(model), str(dst), str(tok))
    assert sorted(p.name for p in dst.iterdir()) == ["chat_template.jinja", "config.json", "generation_config.json",
                                                     "tokenizer.json"]
    assert json.loads((dst / "config.json").read_text())["model_type"] == "qwen3_moe"  # the model's, not the tokenizer's
