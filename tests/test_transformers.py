"""flash_ext inside Hugging Face transformers models (``flash_ext.integrations.transformers``).

Real transformers code paths (mask builders, KV caches, ``generate``) on tiny models built from configs
with random weights, so nothing is downloaded.  Every check compares the model running ``fx_attention``
with the same weights running transformers' eager attention:

* fp32: cosine similarity >= 0.9999 over the real (non-padding) positions; a control shows the bound
  rejects a mis-masked result.
* bf16: the FlashAttention rule, applied to the model output: max |fx_bf16 - eager_fp32| <=
  2 * max |eager_bf16 - eager_fp32| + one bf16 ulp of the output's magnitude.
* generate(): exactly the eager model's tokens (fp32, greedy).

Skipped (with the reason) when transformers is not installed or its version has another attention
contract.  Dropout and the backward pass are checked for what flash_ext does today, found by calling it:
while flash_ext refuses them, the model must raise ``NotImplementedError`` (never silently skip dropout),
and the tests of their results are skipped with flash_ext's own message.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from typing import Callable, Optional

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed (pip install '.[transformers]')")

import flash_ext  # noqa: E402
from flash_ext.integrations import transformers as fx_hf  # noqa: E402

try:
    NAME = fx_hf.register()
except ImportError as exc:  # an installed transformers with another contract
    pytest.skip(str(exc), allow_module_level=True)

from transformers import (  # noqa: E402
    BertConfig, BertModel, Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM,
)

BATCH, SEQLEN, VOCAB = 3, 12, 128


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models are tiny: a second thread only adds synchronisation, which on a busy machine costs more
    than the work (generation ran 3-6x slower with 2 threads under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
LENGTHS = [SEQLEN, 8, 5]          # mixed lengths in one batch; the first row has no padding


def llama_config(kv_heads: int = 2, layers: int = 2) -> LlamaConfig:
    # initializer_range 0.2 (not the default 0.02) so attention is peaked, not near uniform: a wrong mask
    # then moves the output a lot.
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                       initializer_range=0.2)


def bert_config() -> BertConfig:
    return BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, initializer_range=0.2)


def gemma2_config(sliding_window: int = 4) -> Gemma2Config:
    # Layer 0 slides (window 4 < seqlen 12), layer 1 is global; both softcap the logits at 5.
    return Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                        sliding_window=sliding_window, attn_logit_softcapping=5.0, final_logit_softcapping=None,
                        initializer_range=0.2)


def model_pair(cls, config, dtype: torch.dtype = torch.float32):
    """(eager, fx): the same random weights, one with eager attention, one with flash_ext."""
    torch.manual_seed(1234)
    eager = cls(copy.deepcopy(config)).eval().to(dtype)
    eager.set_attn_implementation("eager")
    fx = copy.deepcopy(eager)          # deep copy: its own config, so the two implementations stay apart
    fx.set_attn_implementation(NAME)
    assert fx.config._attn_implementation == NAME and eager.config._attn_implementation == "eager"
    return eager, fx


def padding_mask(side: Optional[str]) -> Optional[torch.Tensor]:
    if side is None:
        return None
    mask = torch.zeros(BATCH, SEQLEN, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        if side == "left":
            mask[row, SEQLEN - n:] = 1
        else:
            mask[row, :n] = 1
    return mask


def real(mask: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ones(BATCH, SEQLEN, dtype=torch.bool) if mask is None else mask.bool()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def output_of(model, ids, mask, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids, attention_mask=mask, **kwargs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def assert_matches_eager_fp32(eager, fx, ids, mask, **kwargs) -> float:
    ref, got = output_of(eager, ids, mask, **kwargs), output_of(fx, ids, mask, **kwargs)
    keep = real(mask)
    assert torch.isfinite(got[keep]).all()
    c = cosine(got[keep], ref[keep])
    assert c >= 0.9999, f"cosine {c} < 0.9999"
    return c


def assert_fa2_rule_bf16(cls, config, ids, mask):
    # The reference is eager fp32, not fp64: eager softmaxes in fp32, where fp64's mask value is -inf and
    # a padding row becomes NaN.  fp32's own error is ~1e4 times below bf16's.
    eager32, _ = model_pair(cls, config, torch.float32)
    eager16, fx16 = model_pair(cls, config, torch.bfloat16)
    keep = real(mask)
    ref = output_of(eager32, ids, mask)[keep].double()
    err_fx = (output_of(fx16, ids, mask)[keep].double() - ref).abs().max().item()
    err_eager = (output_of(eager16, ids, mask)[keep].double() - ref).abs().max().item()
    floor = 2.0 ** -8 * ref.abs().max().item()
    assert err_fx <= 2 * err_eager + floor, f"bf16: fx error {err_fx:.3g} > 2 x eager's {err_eager:.3g} + {floor:.3g}"


def ids_for(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQLEN), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------

def test_import_has_no_side_effects():
    """``import flash_ext`` (and the integration module) neither imports transformers nor registers."""
    # Without transformers imported there is nothing to register with, so this also shows that importing
    # the integration registers nothing.
    code = ("import sys, flash_ext, flash_ext.bert_padding, flash_ext.integrations.transformers\n"
            "assert 'transformers' not in sys.modules, 'imported transformers'\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_readme_snippet_runs():
    """The README's "Use it in a model" snippet, run as written."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    block = readme.split("<!-- model-snippet -->")[1].split("<!-- /model-snippet -->")[0]
    code = block.strip().removeprefix("```python").removesuffix("```")
    namespace: dict = {}
    exec(compile(code, "README.md:model-snippet", "exec"), namespace)
    assert namespace["model"].config._attn_implementation == NAME
    assert namespace["tokens"].shape[0] == 2 and 16 < namespace["tokens"].shape[1] <= 16 + 20


def test_register_validates_the_name():
    assert fx_hf.register() == NAME == "fx_attention"          # idempotent
    assert transformers.AttentionInterface()[NAME] is fx_hf.attention_forward
    assert transformers.masking_utils.AttentionMaskInterface()[NAME] is fx_hf.mask_interface
    for bad, rule in (("my_flash", "must not contain 'flash'"), ("org/kernel", "hub kernels"),
                      ("sdpa", "transformers' own"), ("", "non-empty")):
        with pytest.raises(ValueError, match=rule):
            fx_hf.register(bad)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("side", ["left", "right", None], ids=["left_pad", "right_pad", "no_pad"])
def test_decoder_matches_eager_fp32(kv_heads, side):
    eager, fx = model_pair(LlamaForCausalLM, llama_config(kv_heads))
    assert_matches_eager_fp32(eager, fx, ids_for(), padding_mask(side))


def test_the_fp32_bound_rejects_a_wrong_mask():
    """Control: the same comparison, with fx ignoring the padding, falls below the bound."""
    eager, fx = model_pair(LlamaForCausalLM, llama_config())
    ids, mask = ids_for(), padding_mask("left")
    keep = real(mask)
    c = cosine(output_of(fx, ids, None)[keep], output_of(eager, ids, mask)[keep])
    assert c < 0.9999


@pytest.mark.parametrize("side", ["left", "right"])
def test_decoder_bf16_fa2_rule(side):
    assert_fa2_rule_bf16(LlamaForCausalLM, llama_config(), ids_for(), padding_mask(side))


@pytest.mark.parametrize("side", ["left", "right", None], ids=["left_pad", "right_pad", "no_pad"])
def test_encoder_matches_eager_fp32(side):
    eager, fx = model_pair(BertModel, bert_config())
    assert not fx.encoder.layer[0].attention.self.is_causal
    assert_matches_eager_fp32(eager, fx, ids_for(), padding_mask(side))


def test_encoder_bf16_fa2_rule():
    assert_fa2_rule_bf16(BertModel, bert_config(), ids_for(), padding_mask("right"))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_padded_batch_same_tokens(cache):
    """Greedy decoding of a left-padded batch: prefill with padding, then 19 steps of one query against a
    growing (dynamic) or preallocated (static, empty tail) KV cache."""
    eager, fx = model_pair(LlamaForCausalLM, llama_config())
    ids, mask = ids_for(), padding_mask("left")
    kwargs = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                  cache_implementation=cache, pad_token_id=0)
    with torch.no_grad():
        ref, got = eager.generate(ids, **kwargs), fx.generate(ids, **kwargs)
    assert got.shape == (BATCH, SEQLEN + 20)
    assert torch.equal(got, ref)


def test_kv_cache_chunk_against_longer_keys():
    """A chunk of 4 queries against 8 cached keys + 4 new ones (bottom-right causal), with padding."""
    eager, fx = model_pair(LlamaForCausalLM, llama_config())
    ids, mask = ids_for(), padding_mask("left")
    outs = []
    for model in (eager, fx):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :8], attention_mask=mask[:, :8], cache=cache)
            outs.append(model(ids[:, 8:], attention_mask=mask, cache=cache).logits)
    keep = mask[:, 8:].bool()
    assert cosine(outs[1][keep], outs[0][keep]) >= 0.9999


@pytest.mark.parametrize("side", ["left", "right", None], ids=["left_pad", "right_pad", "no_pad"])
def test_sliding_window_and_softcap_match_eager(side):
    eager, fx = model_pair(Gemma2ForCausalLM, gemma2_config())
    assert fx.model.layers[0].self_attn.sliding_window == 4
    assert_matches_eager_fp32(eager, fx, ids_for(), padding_mask(side))


def test_sliding_window_and_softcap_generate():
    eager, fx = model_pair(Gemma2ForCausalLM, gemma2_config())
    kwargs = dict(attention_mask=padding_mask("left"), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                  pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(fx.generate(ids_for(), **kwargs), eager.generate(ids_for(), **kwargs))


def test_sliding_window_is_not_a_no_op():
    """Control for the test above: the window changes the result (window 4 vs one spanning the input)."""
    _, fx = model_pair(Gemma2ForCausalLM, gemma2_config())
    _, fx_wide = model_pair(Gemma2ForCausalLM, gemma2_config(sliding_window=SEQLEN))
    assert cosine(output_of(fx, ids_for(), None), output_of(fx_wide, ids_for(), None)) < 0.9999


@pytest.mark.parametrize("side", ["left", "right"])
def test_bidirectional_window_with_padding_matches_reference(side):
    """A bidirectional sliding window (ModernBERT's local layers) over a padded batch, against eager's rule
    |i - j| < w on the padded positions in float64.  Packing only the keys shifted every right-padded row's
    window by its padding (error ~2): the queries are packed too."""
    class Module(torch.nn.Module):
        is_causal = False

    torch.manual_seed(0)
    b, h, s, d, w = 2, 2, 10, 16, 3
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(b, s, dtype=torch.bool)
    if side == "right":
        mask[1, 6:] = False
    else:
        mask[1, :4] = False
    got, _ = fx_hf.attention_forward(Module(), q.float(), k.float(), v.float(), mask, scaling=d ** -0.5,
                                     sliding_window=w)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = ((i - j).abs() <= w - 1)[None, None] & mask[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5
    ref = (torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v).transpose(1, 2)
    assert (got.double() - ref)[mask].abs().max() < 1e-5


def t5gemma_encoder_config(sliding_window: int = 3):
    from transformers import T5GemmaConfig, T5GemmaModuleConfig
    module = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=sliding_window,
                  layer_types=["sliding_attention"] * 2, initializer_range=0.2, dropout_rate=0.0,
                  attention_dropout=0.0)
    return T5GemmaConfig(encoder=T5GemmaModuleConfig(**module), decoder=T5GemmaModuleConfig(**module),
                         vocab_size=VOCAB, dropout_rate=0.0, attention_dropout=0.0, pad_token_id=0,
                         is_encoder_decoder=False)


@pytest.mark.parametrize("side", [None, "left", "right"])
def test_bidirectional_window_stated_by_the_mask(side):
    """T5Gemma's encoder passes its layers the mask's own window (keys at distance <= w), where ModernBERT passes
    w + 1 (flash_attention_2's convention, w - 1 per side): read from the layer's argument, the window was one
    key too narrow per side (encoder output off by up to 2.6 of 3.8).  The mask pattern's window is taken."""
    transformers_mod = pytest.importorskip("transformers")
    if not hasattr(transformers_mod, "T5GemmaEncoderModel"):
        pytest.skip("this transformers has no T5Gemma")
    eager, fx = model_pair(transformers_mod.T5GemmaEncoderModel, t5gemma_encoder_config())
    assert_matches_eager_fp32(eager, fx, ids_for(), padding_mask(side))


@pytest.mark.parametrize("use_cache", [False, None], ids=["no_cache", "default_cache"])
def test_packed_sequences_match_separate_sequences(use_cache):
    """Padding-free batch: three sequences in one row, told apart by position_ids restarting at 0
    (DataCollatorWithFlattening's default output), against each sequence run alone.  With use_cache at its
    default (True) transformers' mask builders do not look for packing, so eager (the old reference of this
    test, which therefore could not fail) lets the sequences attend to each other; flash_attention_2 reads the
    packing from the position_ids the layers pass, and so does fx_attention."""
    eager, fx = model_pair(LlamaForCausalLM, llama_config())
    ids = ids_for()[:1]
    lengths = [4, 3, 5]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    kwargs = {} if use_cache is None else {"use_cache": use_cache}
    with torch.no_grad():
        separate = torch.cat([eager(part).logits for part in ids.split(lengths, dim=1)], dim=1)
        got = fx(ids, position_ids=position_ids, **kwargs).logits
        assert cosine(got, separate) >= 0.9999
        if use_cache is None:  # control: eager with a cache mixes the sequences
            assert cosine(eager(ids, position_ids=position_ids).logits, separate) < 0.9999
        # A gap in the positions without a restart stays one sequence (flash_attention_2's rule, and eager's
        # result); splitting at every step other than +1 differed from eager by 0.36.
        gap = torch.cat([torch.arange(6), torch.arange(9, 15)])[None]
        assert cosine(fx(ids, position_ids=gap, **kwargs).logits, eager(ids, position_ids=gap, **kwargs).logits) >= 0.9999
    with torch.inference_mode():  # inference tensors keep no version counter: reading it raised
        assert cosine(fx(ids, position_ids=position_ids, **kwargs).logits, separate) >= 0.9999
        assert cosine(fx(ids[:, :7]).logits, eager(ids[:, :7]).logits) >= 0.9999  # a plain prompt: one sequence


def test_cpu_autocast_runs_in_the_autocast_dtype():
    """An fp32 model under CPU autocast: rotary embeddings (fp32) bring q and k back to fp32 while v is bf16;
    fx_attention refused the mixed dtypes (casting only on CUDA).  Like transformers' flash path, q, k and v run
    in the autocast dtype: bf16's rule against the fp32 model."""
    eager, fx = model_pair(LlamaForCausalLM, llama_config())
    ids, mask = ids_for(), padding_mask("left")
    keep = real(mask)
    ref = output_of(eager, ids, mask)[keep].double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = output_of(fx, ids, mask)[keep].double()
        eager16 = output_of(eager, ids, mask)[keep].double()
    err_fx, err_eager = (got - ref).abs().max().item(), (eager16 - ref).abs().max().item()
    assert 0 < err_fx <= 2 * err_eager + 2.0 ** -8 * ref.abs().max().item(), (err_fx, err_eager)


def test_sliding_window_with_a_gap_in_the_mask_is_refused():
    """A padding token between real ones: transformers counts a sliding window in positions, flash_ext (packing
    the real tokens) would count real tokens: refused, not answered (it differed from eager by 5.8 on logits of
    5.1).  Without a window the gap is exact (a control that the mask itself is served)."""
    gap = torch.ones(BATCH, SEQLEN, dtype=torch.long)
    gap[1, 3:5] = 0
    _, fx = model_pair(Gemma2ForCausalLM, gemma2_config())
    with pytest.raises(ValueError, match="a row's real tokens are not contiguous .* sliding window"):
        output_of(fx, ids_for(), gap)
    eager, fx = model_pair(Gemma2ForCausalLM, gemma2_config(sliding_window=SEQLEN))
    assert_matches_eager_fp32(eager, fx, ids_for(), gap)  # a window over every key hides nothing: served
    eager, fx = model_pair(LlamaForCausalLM, llama_config())
    assert_matches_eager_fp32(eager, fx, ids_for(), gap)


@pytest.mark.parametrize("side", [None, "left", "right"])
def test_gemma3_bidirectional_matches_eager(side):
    """Gemma-3's bidirectional mode (EmbeddingGemma): its masks are unions on top of a causal mask (always True
    for full layers; |i - j| < w for sliding ones), refused as "a union of patterns" before; read exactly now:
    bidirectional attention and a bidirectional window of w - 1 keys per side."""
    transformers_mod = pytest.importorskip("transformers")
    if not hasattr(transformers_mod, "Gemma3TextModel"):
        pytest.skip("this transformers has no Gemma-3")
    config = transformers_mod.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        use_bidirectional_attention=True, initializer_range=0.2)
    eager, fx = model_pair(transformers_mod.Gemma3TextModel, config)
    assert_matches_eager_fp32(eager, fx, ids_for(), padding_mask(side))


@pytest.mark.parametrize("side", [None, "left"], ids=["no_pad", "left_pad"])
def test_torch_compile_forward(side):
    """One forward of the compiled model as a single graph (fullgraph; backend aot_eager: Dynamo capture,
    the fake kernels and AOT autograd, without inductor's C++ build).  With padding the unpadding's token
    count is data-dependent (nonzero): Dynamo captures it with capture_dynamic_output_shape_ops, otherwise
    it breaks the graph there, as it does in transformers' own flash-attention path."""
    eager, fx = model_pair(LlamaForCausalLM, llama_config(layers=1))   # one layer: compile time is per layer
    torch._dynamo.reset()
    ids, mask = ids_for(), padding_mask(side)
    keep = real(mask)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=side is not None):
        compiled = torch.compile(fx, backend="aot_eager", fullgraph=True)
        got = output_of(compiled, ids, mask)
    assert cosine(got[keep], output_of(eager, ids, mask)[keep]) >= 0.9999


# ---------------------------------------------------------------------------------------------------------
# what it cannot serve: an error, not an answer

@pytest.mark.parametrize("side", [None, "left"], ids=["no_pad", "left_pad"])
def test_paligemma_text_is_causal_as_its_mask(side):
    """PaliGemma's config makes every language-model layer call itself non-causal (use_bidirectional_attention)
    while its text masks are causal, and eager applies the mask: fx_attention trusted the layers' flag and ran
    bidirectional attention (logits off by 0.1, silently).  The mask decides now."""
    transformers_mod = pytest.importorskip("transformers")
    if not hasattr(transformers_mod, "PaliGemmaForConditionalGeneration"):
        pytest.skip("this transformers has no PaliGemma")
    config = transformers_mod.PaliGemmaConfig(
        text_config=dict(model_type="gemma", vocab_size=VOCAB + 8, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                         pad_token_id=0, initializer_range=0.2),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                           image_size=32, patch_size=8, projection_dim=64),
        image_token_id=VOCAB + 4, projection_dim=64)
    eager, fx = model_pair(transformers_mod.PaliGemmaForConditionalGeneration, config)
    assert not any(layer.self_attn.is_causal for layer in fx.model.language_model.layers)
    ids, mask = ids_for(), padding_mask(side)
    keep = real(mask)
    with torch.no_grad():
        ref = eager(input_ids=ids, attention_mask=mask).logits
        got = fx(input_ids=ids, attention_mask=mask).logits
    assert cosine(got[keep], ref[keep]) >= 0.9999


def test_pixtral_block_mask_matches_eager():
    """Pixtral's vision tower hands implementations without "flash" in their name a dense block-diagonal mask
    (one block per image) instead of cu_seq_lens: read exactly as packed sequences (it was refused)."""
    transformers_mod = pytest.importorskip("transformers")
    if not hasattr(transformers_mod, "PixtralVisionModel"):
        pytest.skip("this transformers has no Pixtral")
    config = transformers_mod.PixtralVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, image_size=32, patch_size=8, head_dim=16,
                                                  initializer_range=0.2)
    eager, fx = model_pair(transformers_mod.PixtralVisionModel, config)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    sizes = torch.tensor([[32, 32], [16, 24]])                      # two images: blocks of 16 and 6 patches
    with torch.no_grad():
        ref = eager(pixel_values=pixels, image_sizes=sizes).last_hidden_state
        got = fx(pixel_values=pixels, image_sizes=sizes).last_hidden_state
        one_block = fx(pixel_values=pixels[:1], image_sizes=sizes[:1]).last_hidden_state
    assert ref.shape == got.shape == (1, 22, 64) and cosine(got, ref) >= 0.9999
    assert cosine(got[:, :16], one_block) >= 0.9999 and cosine(got, got.flip(1)) < 0.9999


@pytest.mark.parametrize("kind", ["bool", "additive", "causal", "broadcast_batch", "per_head"])
def test_dense_block_masks_against_a_reference(kind):
    """The dense-mask reader against softmax over the mask itself (float64): blocks of 3, 5 and 4 tokens per
    row, a second batch row with other blocks; bool, additive (0 / finfo.min) and causal-inside-blocks masks."""
    class Module(torch.nn.Module):
        is_causal = False  # the mask states causality: the layer's flag must not override it

    torch.manual_seed(0)
    b, h, s, d = 2, 2, 12, 16
    allowed = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for row, lengths in enumerate(([3, 5, 4], [7, 1, 4])):
        start = 0
        for n in lengths:
            allowed[row, 0, start:start + n, start:start + n] = True
            start += n
    if kind == "causal":
        allowed &= torch.ones(s, s, dtype=torch.bool).tril()
    if kind == "broadcast_batch":  # one (1, 1, s, s) mask for the whole batch
        allowed = allowed[:1].expand(b, 1, s, s)
    mask = allowed if kind != "additive" else torch.zeros(b, 1, s, s).masked_fill(~allowed, torch.finfo(torch.float32).min)
    if kind == "broadcast_batch":
        mask = mask[:1]
    if kind == "per_head":  # the same mask written out for every head
        mask = mask.expand(b, h, s, s).contiguous()
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3))
    got, _ = fx_hf.attention_forward(Module(), q.float(), k.float(), v.float(), mask, scaling=d ** -0.5)
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5
    ref = (torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v).transpose(1, 2)
    assert (got.double() - ref).abs().max() < 1e-5


def test_dense_masks_that_are_not_blocks_are_refused():
    """Off-block entries, a bias value, a row that sees nothing: refused, not approximated."""
    q = torch.randn(1, 2, 8, 16)
    blocks = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    blocks[..., :4, :4] = blocks[..., 4:, 4:] = True
    extra = blocks.clone()
    extra[..., 5, 1] = True
    biased = torch.zeros(1, 1, 8, 8).masked_fill(~blocks, float("-inf"))
    biased[..., 0, 0] = -0.5
    empty = blocks.clone()
    empty[..., 6, :] = False
    heads_differ = blocks.expand(1, 2, 8, 8).clone()
    heads_differ[0, 1, 0, 5] = True
    for bad in (extra, biased, empty, heads_differ):
        with pytest.raises(ValueError, match="attention_mask: got a 4-D"):
            fx_hf.attention_forward(torch.nn.Module(), q, q, q, bad)


def test_4d_mask_is_refused():
    """A user's 4-D mask that is not block-diagonal (a band) is refused; one that is (here all zeros: one block,
    every key, which eager applies as it is, causal model or not) is served as eager serves it."""
    eager, fx = model_pair(LlamaForCausalLM, llama_config())
    i = torch.arange(SEQLEN)
    band = torch.zeros(BATCH, 1, SEQLEN, SEQLEN).masked_fill((i[:, None] - i[None, :]).abs() > 2,
                                                             torch.finfo(torch.float32).min)
    with pytest.raises(ValueError, match="attention_mask: got a 4-D torch.float32 tensor"):
        fx(ids_for(), attention_mask=band)
    every_key = torch.zeros(BATCH, 1, SEQLEN, SEQLEN)
    ref, got = output_of(eager, ids_for(), every_key), output_of(fx, ids_for(), every_key)
    assert cosine(got, ref) >= 0.9999 and cosine(got, output_of(fx, ids_for(), None)) < 0.9999


def test_union_pattern_is_refused():
    """E.g. bidirectional image-token blocks inside a causal mask: an or_mask_function."""
    from transformers.masking_utils import create_causal_mask
    _, fx = model_pair(LlamaForCausalLM, llama_config())
    embeds = torch.zeros(BATCH, SEQLEN, 64)
    with pytest.raises(ValueError, match="a union of patterns"):
        create_causal_mask(fx.config, embeds, padding_mask("left"), None,
                           or_mask_function=lambda b, h, q, kv: kv < 2)
    with pytest.raises(ValueError, match="unrecognised mask predicate"):
        create_causal_mask(fx.config, embeds, padding_mask("left"), None,
                           and_mask_function=lambda b, h, q, kv: kv != 3)


def test_falcon_alibi_is_refused_by_name():
    """Falcon with alibi=True folds ALiBi into the attention mask it asks for: without padding it failed inside
    transformers' Falcon code (an AttributeError on the None mask), with padding on the 4-D float mask error,
    neither naming ALiBi.  Refused when the mask is asked for, naming config.alibi."""
    from transformers import FalconConfig, FalconForCausalLM
    config = FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                          initializer_range=0.2)
    _, fx = model_pair(FalconForCausalLM, config)
    for side in (None, "left"):
        with pytest.raises(ValueError, match=r"config\.alibi: got True; .*additive position bias"):
            output_of(fx, ids_for(), padding_mask(side))


def test_unsupported_arguments_are_refused():
    _, fx = model_pair(LlamaForCausalLM, llama_config())
    module = fx.model.layers[0].self_attn
    q = torch.randn(2, 4, 5, 16)
    kv = torch.randn(2, 2, 5, 16)
    with pytest.raises(ValueError, match="s_aux: given"):
        fx_hf.attention_forward(module, q, kv, kv, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match="position_bias: given; flash_ext has no additive position bias; load this model with attn_implementation=.sdpa. or .eager. instead"):
        fx_hf.attention_forward(module, q, kv, kv, None, position_bias=torch.zeros(1, 4, 5, 5))
    with pytest.raises(ValueError, match="attention_mask: got a 2-D torch.float32"):
        fx_hf.attention_forward(module, q, kv, kv, torch.zeros(2, 5))


# ---------------------------------------------------------------------------------------------------------
# dropout and backward: checked against what flash_ext does today

def _refusal(fn: Callable[[], object]) -> Optional[str]:
    """flash_ext's NotImplementedError message when it refuses ``fn``, else None."""
    try:
        fn()
    except NotImplementedError as exc:
        return str(exc)
    return None


def _dropout_refusal() -> Optional[str]:
    x = torch.randn(1, 8, 2, 16)
    return _refusal(lambda: flash_ext.flash_attn_func(x, x, x, dropout_p=0.5))


def _backward_refusal() -> Optional[str]:
    x = torch.randn(1, 8, 2, 16, requires_grad=True)
    return _refusal(lambda: flash_ext.flash_attn_func(x, x, x).sum().backward())


def _dropout_models():
    config = llama_config()
    config.attention_dropout = 0.5
    eager, fx = model_pair(LlamaForCausalLM, config)
    return eager.train(), fx.train()


def test_training_mode_dropout_is_never_silently_skipped():
    """Training with attention dropout either reaches flash_ext's dropout or raises its refusal."""
    _, fx = _dropout_models()
    refusal = _dropout_refusal()
    if refusal is not None:
        with pytest.raises(NotImplementedError, match="dropout"):
            fx(ids_for(), attention_mask=padding_mask("left"))
    else:
        with torch.no_grad():
            trained = fx(ids_for(), attention_mask=padding_mask("left")).logits
            evaluated = fx.eval()(ids_for(), attention_mask=padding_mask("left")).logits
        assert torch.isfinite(trained).all() and not torch.allclose(trained, evaluated)


@pytest.mark.parametrize("side", ["left", None], ids=["left_pad", "no_pad"])
def test_training_mode_dropout_mean_matches_eval(side):
    """Inverted dropout keeps the expectation: the mean over many dropout draws of the attention layer's
    output approaches the output without dropout."""
    refusal = _dropout_refusal()
    if refusal is not None:
        pytest.skip(f"flash_ext refuses dropout: {refusal}")
    _, fx = _dropout_models()
    module = fx.model.layers[0].self_attn
    q, kv = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    mask = None if side is None else torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    base, _ = fx_hf.attention_forward(module.eval(), q, kv, kv, mask, dropout=0.0, scaling=0.25)
    draws = torch.stack([fx_hf.attention_forward(module.train(), q, kv, kv, mask, dropout=0.5, scaling=0.25)[0]
                         for _ in range(400)])
    keep = slice(None) if mask is None else mask[:, -6:]
    assert (draws.mean(0) - base)[keep].abs().max() < 0.25 * base[keep].abs().max()


@pytest.mark.parametrize("side", ["left", "right"])
def test_backward_matches_eager(side):
    """Parameter gradients through unpad -> varlen -> pad, vs eager.  The loss reads only real positions
    (a language-model loss would also read the padding row before a left-padded prompt's first token, whose
    output is arbitrary and differs between implementations)."""
    refusal = _backward_refusal()
    eager, fx = model_pair(LlamaForCausalLM, llama_config())
    ids, mask = ids_for(), padding_mask(side)
    keep = real(mask)
    weight = torch.randn(int(keep.sum()), VOCAB, generator=torch.Generator().manual_seed(7))

    def loss_of(model):
        return (model(ids, attention_mask=mask).logits[keep] * weight).sum()

    if refusal is not None:
        with pytest.raises(NotImplementedError, match="backward"):
            loss_of(fx.train()).backward()
        pytest.skip(f"flash_ext refuses the backward pass: {refusal}")
    grads = []
    for model in (eager.train(), fx.train()):
        model.zero_grad()
        loss_of(model).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert cosine(grads[1], grads[0]) >= 0.9999
