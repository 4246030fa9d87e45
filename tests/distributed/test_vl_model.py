"""Qwen3-VL-MoE: the Megatron model (HF vision tower + GPTModel with interleaved MRoPE and
deepstack, models/qwen3_vl.py) against HF transformers' Qwen3VLMoeForConditionalGeneration,
fp32, on two sequences of 300 tokens with two images each (four grid sizes), at TP1, at TP2
with sequence parallel (an image of each row straddles the split at token 150), EP2 and PP2."""
import pytest
import torch

from dapo_megatron.assets.models import TINY_VL_MOE

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.background]

LOGITS_TOL = 1e-5
SEQ = 300
IMAGE = TINY_VL_MOE["image_token_id"]
START, END = TINY_VL_MOE["vision_start_token_id"], TINY_VL_MOE["vision_end_token_id"]
MERGE = TINY_VL_MOE["vision_config"]["spatial_merge_size"]
# Per row: (text tokens before the image, image grid [t, h, w] in patches), twice. Row 0's second
# image covers tokens 137..166, row 1's 139..170: both cross the TP2 sequence-parallel split at 150.
ROWS = [[(30, (1, 8, 12)), (80, (1, 12, 10))],
        [(100, (1, 6, 4)), (30, (1, 16, 8))]]
LAYOUTS = {"tp1": dict(), "tp2_sp": dict(tp=2), "ep2": dict(ep=2), "pp2": dict(pp=2)}


def _batch(seed: int = 0) -> dict:
    """tokens [2, SEQ], pixel_values [N_patches, 3*2*8*8], image_grid_thw [4, 3]."""
    g = torch.Generator().manual_seed(seed)
    vc = TINY_VL_MOE["vision_config"]
    patch_dim = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2
    rows, grids = [], []
    for row in ROWS:
        ids = []
        for n_text, grid in row:
            ids += torch.randint(0, IMAGE, (n_text,), generator=g).tolist()
            ids += [START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // MERGE ** 2) + [END]
            grids.append(grid)
        ids += torch.randint(0, IMAGE, (SEQ - len(ids),), generator=g).tolist()  # the "response"
        rows.append(ids)
    grids = torch.tensor(grids)
    pixels = torch.randn(int(grids.prod(-1).sum()), patch_dim, generator=g)
    return dict(tokens=torch.tensor(rows), pixel_values=pixels, image_grid_thw=grids)


def _hf_logits(model, micro: dict) -> torch.Tensor:
    kw = {k: micro[k] for k in ("pixel_values", "image_grid_thw") if k in micro}
    with torch.no_grad():
        return model(input_ids=micro["tokens"], mm_token_type_ids=(micro["tokens"] == IMAGE).int(), **kw).logits


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    """(HF dir, micro-batches, HF transformers logits [2, SEQ, V] of each): the image batch and a
    text-only one (no tower, no deepstack: plain text positions)."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from dapo_megatron.assets.models import build_tiny_vl_model
    hf_dir = build_tiny_vl_model(str(tmp_path_factory.mktemp("qwen3_vl_moe")), seed=0)
    text_only = dict(tokens=torch.randint(0, IMAGE, (2, SEQ), generator=torch.Generator().manual_seed(1)))
    micros = [_batch(), text_only]
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return hf_dir, micros, [_hf_logits(model, m) for m in micros]


def test_the_batch_has_what_the_test_claims():
    batch = _batch()
    image = batch["tokens"] == IMAGE
    assert image[:, 149].all() and image[:, 150].all()  # images straddle the TP2 SP split
    assert len({tuple(g) for g in batch["image_grid_thw"].tolist()}) == 4


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_hf(layout, vl_model):
    from vl_jobs import vl_logits

    from dapo_megatron.train.parallel import run_workers
    hf_dir, micros, refs = vl_model
    parallel = {"tp": 1, "pp": 1, "ep": 1, "etp": 1, **LAYOUTS[layout]}
    per_rank = run_workers(vl_logits, max(parallel.values()), hf_dir, parallel, micros, timeout_s=600)
    ours = next(r["logits"] for r in per_rank if r["logits"] is not None)
    diffs = [(o[..., :ref.shape[-1]] - ref).abs().max().item() for o, ref in zip(ours, refs)]
    print(f"qwen3_vl_moe {layout}: max |logits - HF| = {diffs[0]:.2e} with images, {diffs[1]:.2e} text only "
          f"(logit scale {refs[0].abs().max().item():.2f})")
    assert max(diffs) <= LOGITS_TOL
    towers = [r for r in per_rank if r["n_tower"]]
    assert len(towers) == max(1, parallel["tp"] * parallel["ep"])  # the first stage's ranks only
    assert all(r["tp_avg"] and not r["tp_split"] for r in towers)


def test_tower_gradients_are_whole_and_equal_on_every_tp_rank(vl_model):
    """TP2 + SP: each rank's tower gradient is the full TP1 one (the SP scatter's backward
    gathers the embedding gradient), so the TP average of finalize_model_grads keeps it."""
    from actor_jobs import unpack
    from vl_jobs import vl_tower_grads

    from dapo_megatron.train.parallel import run_workers
    hf_dir, micros, _ = vl_model
    one = dict(tp=1, pp=1, ep=1, etp=1)
    ref = unpack(run_workers(vl_tower_grads, 1, hf_dir, one, micros[0], timeout_s=300)[0])
    ranks = [unpack(r) for r in run_workers(vl_tower_grads, 2, hf_dir, {**one, "tp": 2}, micros[0], timeout_s=300)]
    scale = max(g.abs().max().item() for g in ref.values())
    diff = max((r[n] - g).abs().max().item() for r in ranks for n, g in ref.items())
    print(f"qwen3_vl_moe tower grads: TP2 ranks vs TP1 max |diff| = {diff:.2e} (grad scale {scale:.2e})")
    assert len(ref) == len(ranks[0]) == len(ranks[1]) > 0 and scale > 0
    assert diff <= 1e-5 * max(1.0, scale)
