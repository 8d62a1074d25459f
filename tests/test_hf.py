"""Hugging Face transformers on attngen kernels: attngen.hf.register adds an attn_implementation that
tiny random Llama, Gemma-2, gpt-oss and DeepSeek-V3 models run through (causal, GQA, padding, packed sequences, Gemma-2's
softcap, scaling and sliding window, gpt-oss's attention sinks, DeepSeek's value head dimension, cached generation,
dropout in training).

The rule is the project's (attngen/tools/verify.py): the truth is the same model in float64 with transformers' eager
attention and masks, its softmax in float64 too (`float64_eager`: transformers' eager attention upcasts only to
float32); attngen's logits must be within 2x, and its gradients within 3x, the error of the float32 eager model,
plus a floor of a few float32 ulps at the result's magnitude. Any NaN fails."""
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, DeepseekV3Config, Gemma2Config, GptOssConfig, LlamaConfig
from transformers import masking_utils
from transformers.masking_utils import AttentionMaskInterface

import attngen
import attngen.hf as hf
from attngen.tools import verify

NAME = "attngen_test"
FLOAT64 = "attngen_test_float64_eager"
EPS32 = torch.finfo(torch.float32).eps

LLAMA = LlamaConfig, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=128, max_position_embeddings=64, initializer_range=0.2)  # scores of order 1: peaked rows
# Gemma-2: layer 0 slides (4 tokens), layer 1 is full; softcap 1.0 and a scale of 1/sqrt(32) at head_dim 16 both matter
GEMMA2 = Gemma2Config, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, vocab_size=128, max_position_embeddings=64, sliding_window=4, attn_logit_softcapping=1.0,
                            query_pre_attn_scalar=32, initializer_range=0.5)
# gpt-oss: a learned sink per head in every layer, layer 0 slides (4 tokens), layer 1 is full; a small mixture of experts
GPT_OSS = GptOssConfig, dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, vocab_size=128, max_position_embeddings=64, sliding_window=4, num_local_experts=4,
                             num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], initializer_range=0.5,
                             rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
# DeepSeek-V3's multi-head latent attention in its training form: q.k over 16 + 8 rotary columns, V of 16 (the
# spec's value_dim), keys and values expanded from a 32-wide latent; dense MLPs (no expert layer)
DEEPSEEK = DeepseekV3Config, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                  q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                  first_k_dense_replace=2, vocab_size=128, max_position_embeddings=64, initializer_range=0.2)
B, N = 2, 12


def float64_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, s_aux=None, **kwargs):
    """transformers' eager attention (Gemma-2's, with softcap; gpt-oss's, with sinks) with the softmax in the inputs'
    precision."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(2, 3) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask
    if s_aux is not None:  # gpt-oss: one more logit per row, with no value
        sinks = s_aux.to(scores).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        return (torch.cat([scores, sinks], -1).softmax(-1)[..., :-1] @ value).transpose(1, 2).contiguous(), None
    return (scores.softmax(-1) @ value).transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module")
def attention(target):
    AttentionInterface.register(FLOAT64, float64_eager)
    AttentionMaskInterface.register(FLOAT64, masking_utils.eager_mask)  # eager's additive masks, in the model's dtype
    return hf.register(NAME, target=target)


def _models(family, device, **changes):
    """(attngen float32, eager float32, float64 truth), one set of random weights."""
    cls, settings = family
    # gpt-oss's experts as a loop of matrix products (its grouped kernel takes no float64)
    experts = {"experts_implementation": "eager"} if cls is GptOssConfig else {}
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(cls(**{**settings, **changes}), attn_implementation="eager", **experts).to(device)
    ours = AutoModelForCausalLM.from_config(cls(**{**settings, **changes}), attn_implementation=NAME, **experts).to(device)
    ours.load_state_dict(eager.state_dict())
    truth = AutoModelForCausalLM.from_config(cls(**{**settings, **changes}), attn_implementation=FLOAT64, **experts).to(device, torch.float64)
    truth.load_state_dict(eager.state_dict())
    return ours, eager, truth


def _batch(device, layout: str):
    """Token ids, targets, the model's keyword arguments and the positions whose logits count. `layout`: "unpadded";
    "padded" (an attention mask: row 0 left-padded by 3, row 1 right-padded by 2); "packed" (two sequences per
    row, 5 + 7 and 8 + 4 tokens: position_ids restart, no attention mask)."""
    gen = torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, 128, (B, N), generator=gen).to(device) for _ in range(2))
    mask = torch.ones(B, N, dtype=torch.long, device=device)
    kwargs = {}
    if layout == "padded":
        mask[0, :3] = 0
        mask[1, -2:] = 0
        kwargs["attention_mask"] = mask
    elif layout == "packed":
        kwargs["position_ids"] = torch.tensor([[*range(5), *range(7)], [*range(8), *range(4)]], device=device)
    return ids, targets, kwargs, mask.bool()


def _run(model, ids, targets, kwargs, kept):
    """Logits at the kept positions, and the gradient of every parameter of the cross-entropy there (a training
    step: no cache, so restarting position_ids make transformers build a packed-sequence mask)."""
    model.zero_grad()
    logits = model(ids, use_cache=False, **kwargs).logits[kept]
    F.cross_entropy(logits, targets[kept]).backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def _bound(naive: torch.Tensor, truth: torch.Tensor, factor: int) -> float:
    return factor * (naive.double() - truth).abs().max().item() + verify.FLOOR_ULPS * EPS32 * max(1.0, truth.abs().max().item())


def _check_model(family, device, layout: str, **changes) -> float:
    """attngen's logits and gradients against the truth, within the budget; returns the logits' bound."""
    ours, eager, truth = _models(family, device, **changes)
    ids, targets, kwargs, kept = _batch(device, layout)
    logits, grads = _run(ours, ids, targets, kwargs, kept)
    eager_logits, eager_grads = _run(eager, ids, targets, kwargs, kept)
    true_logits, true_grads = _run(truth, ids, targets, kwargs, kept)
    assert not torch.isnan(logits).any() and not any(torch.isnan(g).any() for g in grads.values())
    bound = _bound(eager_logits, true_logits, 2)
    err = (logits.double() - true_logits).abs().max().item()
    assert err <= bound, f"logits: error {err:.3g} above the bound {bound:.3g}"
    for name, g in grads.items():
        err, g_bound = (g.double() - true_grads[name]).abs().max().item(), _bound(eager_grads[name], true_grads[name], 3)
        assert err <= g_bound, f"d{name}: error {err:.3g} above the bound {g_bound:.3g}"
    if layout != "unpadded":  # the padding (the packing) matters: the float64 model without it is far from its logits
        with torch.no_grad():
            gap = (truth(ids, use_cache=False).logits[kept] - true_logits).abs().max().item()
        assert gap > 100 * bound
    return bound


LAYOUTS = ("unpadded", "padded", "packed")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llama_matches_eager(attention, device, layout):
    """Causal, GQA (4 query heads, 2 key/value heads), the padding mask mapped to a key-padding input, packed
    sequences to a sequence-id input."""
    _check_model(LLAMA, device, layout)
    assert any(c.padding == (layout == "padded") and c.packed == (layout == "packed") and c.window is None and c.softcap is None
               for c in attention.kernels)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gemma2_softcap_scaling_and_sliding_window(attention, device, layout):
    """Gemma-2: a sliding layer and a full one, logit softcapping, query_pre_attn_scalar's scale. Each of the
    three matters: the float64 model without it is far from the budget."""
    bound = _check_model(GEMMA2, device, layout)
    seen = {(c.window, c.softcap, c.scale, c.padding, c.packed) for c in attention.kernels}
    padding, packed = layout == "padded", layout == "packed"
    assert {(4, 1.0, 32 ** -0.5, padding, packed), (None, 1.0, 32 ** -0.5, padding, packed)} <= seen
    if layout == "unpadded":
        ids = _batch(device, layout)[0]
        with torch.no_grad():
            true_logits = _models(GEMMA2, device)[2](ids).logits
            for change in ({"attn_logit_softcapping": None}, {"sliding_window": N}, {"query_pre_attn_scalar": 16}):
                gap = (_models(GEMMA2, device, **change)[2](ids).logits - true_logits).abs().max().item()
                assert gap > 100 * bound, change


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpt_oss_sinks_and_sliding_window(attention, device, layout):
    """gpt-oss: every layer's learned sinks (s_aux, one per head) as the spec's sink, their gradients through the
    kernel, a sliding layer and a full one. The sinks matter: the float64 model without them is far from the budget."""
    bound = _check_model(GPT_OSS, device, layout)
    padding = layout == "padded"  # (restarting position_ids: gpt-oss's model builds no packed-sequence mask, eager neither)
    assert {(4, padding), (None, padding)} <= {(c.window, c.padding) for c in attention.kernels if c.sinks}
    if layout == "unpadded":
        ids = _batch(device, layout)[0]
        truth = _models(GPT_OSS, device)[2]
        with torch.no_grad():
            true_logits = truth(ids).logits
            for module in truth.modules():
                if hasattr(module, "sinks"):
                    module.sinks.fill_(float("-inf"))  # exp(-inf) = 0: no sink
            assert (truth(ids).logits - true_logits).abs().max().item() > 100 * bound


@pytest.mark.parametrize("layout", LAYOUTS[:2])
def test_deepseek_v3_value_head_dim(attention, device, layout):
    """DeepSeek-V3's attention as it trains: queries and keys of 24 columns (16 + 8 rotary), values of 16 (the spec's
    value_dim), the model's own scaling (1/sqrt(24)); logits and every gradient within the budget."""
    _check_model(DEEPSEEK, device, layout)
    assert {(24, 16, layout == "padded")} <= {(c.head_dim, c.value_dim, c.padding) for c in attention.kernels}


@pytest.mark.parametrize("family", [LLAMA, GEMMA2, GPT_OSS, DEEPSEEK], ids=["llama", "gemma2", "gpt_oss", "deepseek_v3"])
def test_cached_generation_matches_eager(attention, device, family):
    """Greedy generation from a left-padded batch: the decoding steps run one query against the cache (queries
    aligned to the last key; Gemma-2's sliding layers keep only the last tokens, so their keys start past 0)."""
    ours, eager, _ = _models(family, device)
    ids, _, kwargs, _ = _batch(device, "padded")
    mask = kwargs["attention_mask"]
    mask[1] = 1  # generation pads on the left only
    args = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **args), eager.generate(ids, **args))
    softcap = family[1].get("attn_logit_softcapping")
    windows = {None, family[1]["sliding_window"]} if "sliding_window" in family[1] else {None}
    assert {(w, softcap) for w in windows} <= {(c.window, c.softcap) for c in attention.kernels if not c.aligned}


def test_dropout_applies_in_training_only(attention, device):
    """The layer's dropout runs in the kernel while module.training (the pattern attngen.dropout_mask gives for the
    seed drawn from torch's generator), and not in evaluation, as in transformers' eager attention."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 9, 16, generator=gen).to(device) for h in (4, 2, 2))
    module = types.SimpleNamespace(training=True, is_causal=True)
    torch.manual_seed(5)
    out, weights = attention(module, q, k, v, None, scaling=0.3, dropout=0.25)
    torch.manual_seed(5)
    seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device))  # the kernel's default seed (runtime.checks.dropout_args)
    keep = attngen.dropout_mask(seed, 0.25, 1, 4, 9, 9, device=device)
    assert weights is None and out.shape == (1, 9, 4, 16)
    assert torch.allclose(out.double(), _naive(q, k, v, 0.3, keep / (1 - attngen.dropout_probability(0.25))), atol=1e-5)
    module.training = False
    out, _ = attention(module, q, k, v, None, scaling=0.3, dropout=0.25)
    assert torch.allclose(out.double(), _naive(q, k, v, 0.3, 1.0), atol=1e-5)


def _naive(q, k, v, scale: float, weights) -> torch.Tensor:
    """Causal attention in float64 with the probabilities multiplied by `weights`, as (B, N, H, D)."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(2, 3) * scale).masked_fill(~torch.ones(9, 9, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return ((scores.softmax(-1) * weights) @ v).transpose(1, 2)


def _call(attention, mask=None, device="cpu", head_dim=16, dtype=torch.float32, **kwargs):
    q, k, v = (torch.zeros(1, h, 5, head_dim, dtype=dtype, device=device) for h in (4, 2, 2))
    return attention(types.SimpleNamespace(training=False, is_causal=kwargs.pop("module_causal", True)), q, k, v, mask, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(output_attentions=True), "output_attentions=True is not supported"),
    (dict(position_bias=torch.zeros(1)), "does not support a position bias"),
    (dict(s_aux=torch.zeros(3)), r"attention sinks \(s_aux\) as one value per query head, \(4,\); this layer passes \(3,\)"),
    (dict(mask=torch.zeros(1, 1, 5, 5)), r"this layer got a Tensor of shape \(1, 1, 5, 5\)"),
    (dict(module_causal=False), r"this layer is not causal"),
    (dict(is_causal=False), r"this layer is not causal"),
    (dict(head_dim=8), "head dimensions 16..256; this model's is 8"),
    (dict(dtype=torch.float64), "this model's is torch.float64"),
    (dict(softcap=-1.0), "softcap must be a positive number"),
    (dict(mask=hf.Mask(None, 4), sliding_window=8), "a sliding window of 8 tokens, but the model's mask has 4"),
])
def test_unsupported_calls_raise(attention, device, kwargs, message):
    with pytest.raises(hf.UnsupportedAttention, match=message):
        _call(attention, device=device, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(mask_function=masking_utils.bidirectional_mask_function), "bidirectional"),
    (dict(mask_function=masking_utils.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))), r"another pattern: and_masks\(chunked_overlay, causal_mask_function\)"),
    (dict(mask_function=masking_utils.sliding_window_bidirectional_mask_function(4)), "another pattern"),
    (dict(q_offset=torch.tensor(3), kv_length=8), "static cache"),
    (dict(q_offset=2, kv_length=8), "places 4 queries at position 2 and 8 keys at 0"),
])
def test_unsupported_masks_raise(attention, kwargs, message):
    """transformers' mask interface under attngen's name: patterns other than (sliding-window) causal are refused."""
    make = AttentionMaskInterface()[NAME]
    with pytest.raises(hf.UnsupportedAttention, match=message):
        make(**{"batch_size": 1, "q_length": 4, "kv_length": 4, **kwargs})


def test_masks_carry_padding_packing_and_window(attention):
    """The masks the model's layers receive: the padding (over the keys of this call), the ids of packed sequences
    (composed as recent transformers do, and as 4.57 and 5.0 do), the window."""
    make = AttentionMaskInterface()[NAME]
    padding = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]).bool()
    mask = make(batch_size=2, q_length=2, kv_length=4, q_offset=4, kv_offset=2, attention_mask=padding,
                mask_function=masking_utils.sliding_window_causal_mask_function(3))
    assert mask.window == 3 and mask.keep is None and mask.sequence is None  # keys 2..5 are all real tokens
    mask = make(batch_size=2, q_length=6, kv_length=7, q_offset=1, kv_offset=0, attention_mask=padding)
    assert mask.window is None and mask.keep.tolist() == [[False] + [True] * 5 + [False], [True] * 6 + [False]]
    older = make(batch_size=2, cache_position=torch.arange(1, 7), kv_length=7, attention_mask=padding)  # older transformers
    assert torch.equal(older.keep, mask.keep)

    positions = torch.tensor([[0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])
    ids = masking_utils.find_packed_sequence_indices(positions)
    bases = [masking_utils.sliding_window_causal_mask_function(3)]  # transformers 4.57 and 5.0
    remap = getattr(masking_utils, "remap_positions_for_packed_sequence", None)  # newer (5.24 has it, 5.17 not)
    if remap is not None:
        bases.append(remap(masking_utils.sliding_window_causal_mask_function(3), positions))
    for base in bases:
        function = masking_utils.and_masks(base, masking_utils.packed_sequence_mask_function(ids))
        mask = make(batch_size=2, q_length=6, kv_length=6, mask_function=function)
        assert mask.window == 3 and mask.keep is None and mask.sequence.tolist() == [[0, 0, 1, 1, 1, 1], [0] * 6]
    one = masking_utils.and_masks(masking_utils.causal_mask_function, masking_utils.packed_sequence_mask_function(torch.zeros(2, 6)))
    assert make(batch_size=2, q_length=6, kv_length=6, mask_function=one).sequence is None  # one sequence per row


PADDED_SPEC = """attention padded_prefix {
    head_dim = 16
    dtype    = fp32
    input attention_mask: bool[B, N]
    mask     = (q_idx >= kv_idx or kv_idx < 2) and attention_mask[b, kv_idx]
}"""


def test_user_spec_replaces_the_mask(attention, device, target):
    """register(name, spec): every layer runs that spec, its padding input receiving the model's padding mask (all
    True for an unpadded batch). Here a prefix-LM (every query sees the first two keys), against the float32 and
    float64 models given the same pattern as a 4-D additive mask; the plain causal mask is far from it."""
    fn = hf.register("attngen_test_spec", PADDED_SPEC, target=target)
    assert fn.kernel.spec.name == "padded_prefix"
    cls, settings = LLAMA
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(cls(**settings), attn_implementation="attngen_test_spec").to(device)
    eager = AutoModelForCausalLM.from_config(cls(**settings), attn_implementation="eager").to(device)
    truth = AutoModelForCausalLM.from_config(cls(**settings), attn_implementation=FLOAT64).to(device, torch.float64)
    eager.load_state_dict(ours.state_dict())
    truth.load_state_dict(ours.state_dict())
    n = torch.arange(N, device=device)

    def additive(allowed, dtype):
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)

    for layout in ("padded", "unpadded"):
        ids, _, kwargs, kept = _batch(device, layout)
        prefix = ((n[:, None] >= n) | (n < 2)) & kept[:, None, None, :]
        with torch.no_grad():
            logits = ours(ids, **kwargs).logits[kept]
            eager_logits = eager(ids, attention_mask=additive(prefix, torch.float32)).logits[kept]
            true_logits = truth(ids, attention_mask=additive(prefix, torch.float64)).logits[kept]
            causal = truth(ids, attention_mask=additive(prefix & (n[:, None] >= n), torch.float64)).logits[kept]
        bound = _bound(eager_logits, true_logits, 2)
        assert (logits.double() - true_logits).abs().max().item() <= bound < (causal - true_logits).abs().max().item() / 100, layout


def test_user_spec_refuses_what_it_cannot_honour(target):
    """A user's spec with an input a model cannot supply, a padded call without a padding input, a scale other
    than the layer's, a sliding window or softcap asked by the layer, packed sequences: errors naming the mismatch."""
    with pytest.raises(hf.UnsupportedAttention, match=r"declares 'attention_mask' as int8\['B', 'N'\]; the padding mask is bool\[B, N\]"):
        hf.register("attngen_test_int8", "attention i { head_dim = 16 dtype = fp32 input attention_mask: int8[B, N] }", target=target)
    with pytest.raises(hf.UnsupportedAttention, match="declares input\\(s\\) doc"):
        hf.register("attngen_test_doc", "attention d { head_dim = 16 dtype = fp32 input doc: int32[B, N] mask = doc[b, q_idx] == doc[b, kv_idx] }",
                    target=target)
    fn = hf.register("attngen_test_causal", "attention c { head_dim = 16 dtype = fp32 mask = q_idx >= kv_idx }", target=target)
    keep = torch.ones(1, 5, dtype=torch.bool)
    keep[0, 0] = False
    with pytest.raises(hf.UnsupportedAttention, match="does not declare `input attention_mask: bool\\[B, N\\]`"):
        _call(fn, hf.Mask(keep, None), scaling=0.25)
    with pytest.raises(hf.UnsupportedAttention, match="scales scores by 0.5, the spec 'c' by 0.25"):
        _call(fn, scaling=0.5)
    with pytest.raises(hf.UnsupportedAttention, match="sliding window of 4 tokens"):
        _call(fn, hf.Mask(None, 4), scaling=0.25)
    with pytest.raises(hf.UnsupportedAttention, match="softcap=50.0"):
        _call(fn, scaling=0.25, softcap=50.0)
    with pytest.raises(hf.UnsupportedAttention, match="packs several sequences per row"):
        _call(fn, hf.Mask(None, None, torch.zeros(1, 5, dtype=torch.int32)), scaling=0.25)


def test_register_refuses_transformers_own_names():
    for name in ("sdpa", "eager", "flash_attention_2", "flex_attention"):
        with pytest.raises(ValueError, match="one of transformers' own attention implementations"):
            hf.register(name)


def test_spec_text_is_a_readable_spec():
    """What a configuration compiles (kernels[config].spec.text): the pattern, scale, softcap and dropout."""
    config = hf._Config(head_dim=64, dtype="bf16", scale=0.125, aligned=False, window=128, softcap=30.0, padding=True, packed=False,
                        dropout=0.1)
    assert config.spec_text() == (
        "attention hf_causal_window128_softcap_padding_dropout {\n"
        "    head_dim = 64\n    dtype = bf16\n    scale = 0.125\n    input attention_mask: bool[B, N]\n"
        "    mask = (q_idx + kv_len - q_len) >= kv_idx and (q_idx + kv_len - q_len) - kv_idx < 128 and attention_mask[b, kv_idx]\n"
        "    score = 30.0 * tanh(score / 30.0)\n    dropout = 0.1\n}\n")
    assert attngen.load_spec(config.spec_text()).dropout == 0.1
