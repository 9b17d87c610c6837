"""The residual-stream rotation on a tiny random Llama: the rotated model equals the original
against a float64 reference, Q is orthogonal and keeps the largest channels, TEAL's tables on
the rotated model are the quantiles of the rotated inputs, bad input is one DejavuError."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from dejavu.compiler.gated_sparsity import LEVELS, calibrate, quantiles
from dejavu.compiler.rotate_llama import fold_norms, pca_basis, residual_moment, rotate_llama, rotate_residual
from dejavu.errors import DejavuError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llama_helpers import tiny_llama  # noqa: E402

KEEP = 3


def _model(**overrides):
    model = tiny_llama(seed=3, **overrides)
    with torch.no_grad():  # massive channels, as pretrained Llamas have, so `keep` has something to keep
        model.model.embed_tokens.weight[:, [5, 17, 30]] *= torch.tensor([30.0, 20.0, 12.0])
    return model


def _ids(seed: int, n: int = 3, s: int = 37):
    return torch.randint(0, 320, (n, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}])
@torch.no_grad()
def test_rotated_model_equals_the_original_against_float64(overrides):
    model = _model(**overrides)
    ids, calib = _ids(1), _ids(2)
    ref = copy.deepcopy(model).double()(ids)  # the unrotated model in float64
    base = model(ids).double()
    rotated = copy.deepcopy(model)
    q = rotate_llama(rotated, calib, KEEP)
    out = rotated(ids).double()
    err, base_err = float((out - ref).abs().max()), float((base - ref).abs().max())
    assert err <= 4 * base_err + 1e-5, (err, base_err)
    assert float((out - ref).norm() / ref.norm()) < 1e-5
    # not the identity: the weights moved (so equality is not trivial)
    assert float((q - torch.eye(q.shape[0], dtype=q.dtype)).abs().max()) > 0.1
    assert not torch.allclose(rotated.layers[0].self_attn.q_proj.weight, model.layers[0].self_attn.q_proj.weight)
    # untied: the embedding and the head are separate tensors now, the config says so
    assert rotated.lm_head.weight.data_ptr() != rotated.model.embed_tokens.weight.data_ptr()
    assert rotated.config.tie_word_embeddings is False


@torch.no_grad()
def test_rotation_is_orthogonal_and_keeps_the_largest_channels():
    model = _model()
    mom = residual_moment(model, _ids(2))
    assert torch.allclose(mom, mom.T, atol=1e-12)
    top = set(mom.diagonal().argsort(descending=True)[:KEEP].tolist())
    assert top == {5, 17, 30}
    q = pca_basis(mom, KEEP)
    eye = torch.eye(q.shape[0], dtype=torch.float64)
    assert float((q.T @ q - eye).abs().max()) < 1e-12
    for c in top:
        assert torch.equal(q[:, c], eye[:, c])
    # the rest: the eigenvectors of their block, by descending eigenvalue (Q^T M Q diagonal there)
    rest = [i for i in range(q.shape[0]) if i not in top]
    rot = (q.T @ mom @ q)[rest][:, rest]
    assert float((rot - torch.diag(rot.diagonal())).abs().max()) < 1e-10 * float(mom.abs().max())
    assert bool((rot.diagonal()[:-1] >= rot.diagonal()[1:] - 1e-12).all())
    # keep 0: the plain PCA basis (eigenvalues of the whole moment)
    q0 = pca_basis(mom, 0)
    assert torch.allclose((q0.T @ mom @ q0).diagonal(), torch.linalg.eigvalsh(mom).flip(0), atol=1e-10)


@torch.no_grad()
def test_teal_tables_of_the_rotated_model_are_the_rotated_inputs_quantiles():
    model = _model()
    calib_ids = _ids(2)
    got = {}
    hooks = [layer.input_layernorm.register_forward_pre_hook(lambda m, a, l=l: got.__setitem__(l, a[0].clone()))
             for l, layer in enumerate(model.layers)]
    model(calib_ids)
    for h in hooks:
        h.remove()
    before = calibrate(model, calib_ids)
    rotated = copy.deepcopy(model)
    q = rotate_llama(rotated, calib_ids, KEEP)
    after = calibrate(rotated, calib_ids)
    for l, x in got.items():  # attn_in of the rotated model: Q^T rmsnorm(x) of the original's residual
        xn = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
        want = quantiles((xn @ q).abs().flatten().float(), LEVELS)
        assert torch.allclose(after.tables["attn_in"][l], want, rtol=1e-4, atol=1e-5)
    # o_proj's and down_proj's inputs do not change basis: the same tables
    for key in ("o_in", "down_in"):
        assert torch.allclose(after.tables[key], before.tables[key], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(after.tables["mlp_in"], before.tables["mlp_in"], rtol=1e-2)


@torch.no_grad()
def test_bad_input_is_one_error():
    model = _model()
    d = model.config.hidden_size
    with pytest.raises(DejavuError, match="fold the RMSNorm weights"):
        rotate_residual(copy.deepcopy(model), torch.eye(d))
    folded = copy.deepcopy(model)
    fold_norms(folded)
    with pytest.raises(DejavuError, match="not orthogonal"):
        rotate_residual(folded, torch.eye(d) * 1.01)
    with pytest.raises(DejavuError, match=r"must be \[48, 48\]"):
        rotate_residual(folded, torch.eye(d - 1))
    with pytest.raises(DejavuError, match="keep must be an integer"):
        rotate_llama(copy.deepcopy(model), _ids(2), d)
    with pytest.raises(DejavuError, match="keep must be an integer"):
        pca_basis(torch.eye(d), -1)
    with pytest.raises(DejavuError, match="square matrix"):
        pca_basis(torch.ones(3, 4), 0)
    with pytest.raises(DejavuError, match="non-finite"):
        pca_basis(torch.full((3, 3), float("nan")), 0)


def _skipped(model, calib, ids, skip: float) -> float:
    from dejavu.compiler.gated_sparsity import GatedSparsity, gated_sparsity

    with torch.no_grad(), gated_sparsity(model, calib, GatedSparsity(skip=skip)) as reads:
        model(ids)
    return reads.skipped


def test_the_builds_rotated_thresholds_skip_their_target_on_heldout_text(tmp_path):
    """The build fits the rotation on the calibration tokens after the thresholds' (build_llama.
    calibrate_inputs): on held-out windows of the corpus its thresholds skip their target. Fitted
    on the threshold tokens themselves, the PCA makes the rotated inputs smaller there than on
    other text, and the thresholds skip visibly less (what the check below would catch)."""
    from dejavu.compiler.build_llama import _Blocks, calibrate_inputs
    from dejavu.compiler.config import BuildConfig
    from dejavu.compiler.text import corpus_tokens
    from dejavu.models.auto import load_llama, load_text_tokenizer
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "tiny", seed=3)
    tok = load_text_tokenizer(folder)
    config = BuildConfig(density=0.6, rotate_keep=2, calib_tokens=512, calib_window=128, dtype="float32")
    stream = torch.as_tensor(corpus_tokens(tok.tokenizer, None, 4096, bos_id=tok.bos_id)[0], dtype=torch.long)
    calib_ids, held = stream[:512].view(4, 128), stream[2048:].view(16, 128)  # held: past both fits' tokens
    model = load_llama(folder)[0]
    with torch.no_grad():
        calib, header = calibrate_inputs(model, tok, config)
    assert header["n_tokens"] == 512 and header["rotation_tokens"] == [512, 1024]
    same = load_llama(folder)[0]
    with torch.no_grad():
        rotate_llama(same, calib_ids, 2)
        same_calib = calibrate(_Blocks(same), calib_ids)
    for skip in (0.25, 0.4, 0.5):
        assert abs(_skipped(model, calib, held, skip) - skip) <= 0.012, skip
        assert _skipped(same, same_calib, held, skip) < skip - 0.015, skip


def test_heldout_text_from_the_calibration_corpus_starts_past_the_rotations_tokens(tmp_path):
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig
    from dejavu.datafiles import CALIB_TEXT
    from dejavu.engine_file import read_header
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "tiny", seed=3)
    corpus = str(CALIB_TEXT)
    for keep, first in ((None, 256), (2, 512)):
        out = tmp_path / f"k{keep}.engine"
        build_engine(folder, BuildConfig(density=0.8, rotate_keep=keep, calib=corpus, heldout=corpus, calib_tokens=256,
                                         calib_window=64, heldout_tokens=128, allocation="uniform", dtype="float32"),
                     out, progress=False)
        source = read_header(out)["build_config"]["heldout"]["source"]
        assert source.endswith(f"tokens [{first + 128}, {first + 256})"), source
