"""attn_implementation="flashtile" in tiny randomly initialised transformers models (no download).

Each model is compared with the same weights under transformers' eager attention (SDPA for the Llama
checks the issue asked for), and every test checks that flashtile's functions actually ran: models built
from one shared config object would all run the implementation of the last one built, since transformers
writes the choice into the config.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashtile.integrations.transformers as integration  # noqa: E402
from flashtile import flash_attn_with_kvcache  # noqa: E402
from flashtile.integrations.transformers import flashtile_attention_forward, flashtile_mask, register  # noqa: E402

VOCAB = 97


@pytest.fixture(autouse=True)
def _torch_backend(backend):
    backend("torch")


@pytest.fixture(autouse=True)
def _no_hub_kernels(monkeypatch):
    """Fails a test in which transformers tries to fetch an attention kernel from the hub (its fallback when
    it does not know an implementation's name). Transformers 5.25 and newer import the `kernels` package with
    every model class, so that the module is loaded says nothing; its fetch being called does."""
    hub_kernels = pytest.importorskip("transformers.integrations.hub_kernels")

    def fetch(*args, **kwargs):
        raise AssertionError(f"transformers tried to fetch a hub kernel: {args} {kwargs}")

    monkeypatch.setattr(hub_kernels, "get_kernel", fetch, raising=False)


@pytest.fixture
def calls(monkeypatch):
    """Counts the integration's calls into flashtile, by function, and keeps the last call's keywords."""
    counts = {"flash_attn_func": 0, "flash_attn_varlen_func": 0, "last_kwargs": None}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            counts["last_kwargs"] = kwargs
            return fn(*args, **kwargs)
        return call

    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        monkeypatch.setattr(integration, name, counted(name, getattr(integration, name)))
    return counts


def _config(family):
    """A tiny config of one model family and its causal-LM class. initializer_range 0.3: random weights
    that give attention a shape (at 0.02 every row is near uniform and masks hardly change the logits)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.3)
    if family == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common)
    if family == "qwen3":  # per-head q/k RMSNorm
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**common)
    if family == "mistral":  # sliding window on every layer
        return transformers.MistralForCausalLM, transformers.MistralConfig(**common, sliding_window=6)
    if family == "gemma2":  # logit softcap, query_pre_attn_scalar scaling, sliding window on alternate layers
        return transformers.Gemma2ForCausalLM, transformers.Gemma2Config(**common, sliding_window=5,
                                                                         attn_logit_softcapping=3.0,
                                                                         query_pre_attn_scalar=20)
    if family == "gemma3":  # a sliding layer and a full one
        return transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
            **common, sliding_window=5, query_pre_attn_scalar=20, layer_types=["sliding_attention", "full_attention"])
    if family == "gpt_oss":  # attention sinks, a sliding layer and a full one, mixture of experts
        return transformers.GptOssForCausalLM, transformers.GptOssConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(family)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gpt_oss"]


def _models(family, reference="eager"):
    """(flashtile model, reference model) with the same weights, each with its own copy of the config."""
    register()
    cls, config = _config(family)
    torch.manual_seed(0)
    ours = cls._from_config(copy.deepcopy(config), attn_implementation="flashtile").eval()
    other = cls._from_config(copy.deepcopy(config), attn_implementation=reference).eval()
    other.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "flashtile"
    assert other.config._attn_implementation == reference
    return ours, other


def _left_padded(batch=3, seqlen=20, pads=(0, 5, 11)):
    ids = torch.randint(1, VOCAB, (batch, seqlen))
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return ids, mask


def test_llama_logits_match_sdpa_with_and_without_padding(calls):
    ours, sdpa = _models("llama", reference="sdpa")
    ids, mask = _left_padded()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, sdpa(ids).logits, atol=1e-4, rtol=1e-4)
        assert calls["flash_attn_func"] == 2  # one per layer
        got, want = ours(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
        assert calls["flash_attn_varlen_func"] == 2
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager_with_and_without_left_padding(family, calls):
    ours, eager = _models(family)
    ids, mask = _left_padded()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, atol=1e-4, rtol=1e-4)
        got, want = ours(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)
    assert calls["flash_attn_func"] == 2 and calls["flash_attn_varlen_func"] == 2
    if family == "gpt_oss":
        assert calls["last_kwargs"]["sink"].shape == (4,)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_same_tokens_as_eager(family, calls):
    ours, eager = _models(family)
    ids, mask = _left_padded(batch=2, seqlen=7, pads=(0, 3))
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))
    assert calls["flash_attn_varlen_func"] > 0


def test_llama_greedy_generation_same_tokens_as_sdpa(calls):
    ours, sdpa = _models("llama", reference="sdpa")
    ids, mask = _left_padded(batch=2, seqlen=7, pads=(0, 3))
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))
    assert calls["flash_attn_varlen_func"] > 0


def test_sinks_reach_flashtile_with_gradients(calls):
    """gpt-oss fine-tuning: the sinks' gradients (and the rest) equal eager attention's."""
    ours, eager = _models("gpt_oss")
    ids, mask = _left_padded(batch=2, seqlen=12, pads=(0, 4))
    labels = ids.masked_fill(mask == 0, -100)
    for model in (ours, eager):
        model.train()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    assert calls["last_kwargs"]["sink"].requires_grad
    for (name, got), want in zip(ours.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-4, rtol=1e-4, msg=name)
    assert ours.model.layers[0].self_attn.sinks.grad.abs().sum() > 0


def _sequences(lengths=(5, 9, 6)):
    return [torch.randint(1, VOCAB, (n,)) for n in lengths]


def _flattened(sequences, flash_kwargs):
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    return collator([{"input_ids": s.tolist()} for s in sequences])


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_batch_logits_equal_each_sequence_alone(family, flash_kwargs, calls):
    """Padding-free rows (DataCollatorWithFlattening): position_ids restarting at each sequence, with or
    without the cu_seq_lens_q/k and max_length_q/k keywords, run as packed varlen sequences."""
    ours, _ = _models(family)
    sequences = _sequences()
    batch = _flattened(sequences, flash_kwargs)
    batch.pop("labels")
    with torch.no_grad():
        alone = torch.cat([ours(s[None]).logits[0] for s in sequences])
        varlen_calls = calls["flash_attn_varlen_func"]
        packed = ours(**batch).logits[0]
    assert calls["flash_attn_varlen_func"] == varlen_calls + 2
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_packed_training_step_gradients_equal_padded_batch(family, calls):
    """One padding-free training step (the collator's labels and flash keywords) against the same sequences
    right-padded with labels -100 on the padding: same loss, same gradients."""
    ours, _ = _models(family)
    ours.train()
    sequences = _sequences((7, 3, 10, 4))
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, :len(s)], mask[row, :len(s)] = s, 1
    padded_loss = ours(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    padded_loss.backward()
    padded_grads = [p.grad.clone() for p in ours.parameters()]
    ours.zero_grad()
    packed_loss = ours(**_flattened(sequences, flash_kwargs=True)).loss
    packed_loss.backward()
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-5, rtol=1e-5)
    for (name, p), want in zip(ours.named_parameters(), padded_grads):
        torch.testing.assert_close(p.grad, want, atol=1e-5, rtol=1e-4, msg=name)


def test_gpt2_training_step_takes_the_packed_gradient(monkeypatch, calls):
    """GPT-2's fused c_attn split into q, k, v, to BHSD and back (its flash-attention path): without a cache (a
    training step's use_cache=False) the slices reach the call as views of the projection, and autograd takes the
    projection (``_ops.packed_base``): every gradient the bits of the three-slice graph's."""
    from flashtile import _ops

    register()
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="flashtile").train()
    ids = torch.randint(0, VOCAB, (2, 16))
    taken = []

    def watched(q, k, v, packed_base=_ops.packed_base):
        taken.append(packed_base(q, k, v))
        return taken[-1]

    monkeypatch.setattr(_ops, "packed_base", watched)
    grads = []
    for packed in (True, False):
        monkeypatch.setattr(_ops, "_PACKED_GRADS", packed)
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert calls["flash_attn_func"] == 4 and [t is not None for t in taken] == [True, True, False, False]
    for with_packing, without in zip(*grads):
        assert torch.equal(with_packing, without)


def _padded_and_packed_step(model, ids, mask, packed):
    """Logits of a left-padded batch, then gradients of its loss plus a packed batch's loss."""
    model.zero_grad()
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    (out.loss + model(**packed).loss).backward()
    return out.logits[mask.bool()].float(), [p.grad.float() for p in model.parameters()]


def test_triton_kernels_in_a_model_within_twice_the_torch_path_error(backend, calls):
    """gpt-oss (sinks, a sliding layer, GQA, padding, a packed batch, backward) through the Triton kernels
    (real on a GPU; on CPU the interpreter, float16 only): logits and gradients within twice the error of
    the PyTorch path in the same dtype, both against the PyTorch path in float32."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours, _ = _models("gpt_oss")
    ours.train()
    ids, mask = (x.to(device) for x in _left_padded(batch=2, seqlen=12, pads=(0, 4)))
    packed = {k: v.to(device) if isinstance(v, torch.Tensor) else v
              for k, v in _flattened(_sequences(), flash_kwargs=True).items()}
    exact = _padded_and_packed_step(ours.to(device), ids, mask, packed)
    half = ours.half()
    torch_half = _padded_and_packed_step(half, ids, mask, packed)
    backend("triton")
    calls["flash_attn_varlen_func"] = 0
    triton_half = _padded_and_packed_step(half, ids, mask, packed)
    assert calls["flash_attn_varlen_func"] == 4  # two layers, padded and packed
    for name, got, base, want in zip(["logits"] + [n for n, _ in ours.named_parameters()], [triton_half[0]] +
                                     triton_half[1], [torch_half[0]] + torch_half[1], [exact[0]] + exact[1]):
        error, base_error = (got - want).abs().max(), (base - want).abs().max()
        assert error <= 2 * base_error + 1e-3, f"{name}: {error:.3e} against the torch path's {base_error:.3e}"


@pytest.mark.parametrize("family, in_graph", [("llama", "0"), ("llama", "1"), ("llama", "paged"), ("gpt_oss", "paged")])
def test_static_cache_generation_under_torch_compile_matches_eager(calls, monkeypatch, family, in_graph):
    """generate() with a static cache and its compiled decoding step (aot_eager: traced through flashtile's
    fake kernels, quick on CPU) gives eager attention's greedy tokens; with FLASHTILE_HF_STEP_IN_GRAPH=1 the
    step is one graph (transformers turns fullgraph off for flash-attention names: graph breaks are counted), and
    with "paged" (the default), attention sinks (gpt-oss) included."""
    monkeypatch.setenv("FLASHTILE_HF_STEP_IN_GRAPH", in_graph)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ours, eager = _models(family)
    ids, mask = _left_padded(batch=2, seqlen=7, pads=(0, 3))
    compile_config = transformers.CompileConfig(backend="aot_eager", mode=None)
    compile_config._compile_all_devices = True  # transformers compiles generate() on CPU only when told to
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    traced_masks = []
    padded = integration._padded

    def spy(q, k, v, attention_mask, options, *rest):
        if torch.compiler.is_compiling():
            traced_masks.append((attention_mask.dtype, tuple(attention_mask.shape), k.shape[1]))
        return padded(q, k, v, attention_mask, options, *rest)

    monkeypatch.setattr(integration, "_padded", spy)
    got = ours.generate(ids, cache_implementation="static", compile_config=compile_config, **kwargs)
    assert hasattr(ours, "_compiled_call")  # the decoding steps ran compiled
    # the static cache's slot codes: one shape for every step (a growing mask would be a new graph each step)
    assert traced_masks and all(m == (torch.int8, (2, slots), slots) for m in traced_masks for slots in [m[2]])
    if in_graph in ("1", "paged"):
        assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch.equal(got, eager.generate(ids, **kwargs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the Triton kernels on a GPU")
@pytest.mark.parametrize("family, in_graph, pads", [
    (family, in_graph, pads) for in_graph in ("0", "1", "paged") for pads in ((0, 0, 0), (0, 2, 5))
    for family in ("llama",)] + [("gpt_oss", in_graph, (0, 2, 5)) for in_graph in ("1", "paged")])
def test_static_cache_generation_compiled_with_cuda_graphs_on_the_gpu(backend, monkeypatch, family, in_graph, pads):
    """transformers' own compile of a static-cache generation (mode "reduce-overhead": CUDA graphs) on a GPU,
    with and without left padding, the step in one graph or not (FLASHTILE_HF_STEP_IN_GRAPH), attention sinks
    (gpt-oss) in the graph: eager flashtile's tokens, every step's logits within 1% of their largest (the
    Triton kernels both ways, fp16)."""
    monkeypatch.setenv("FLASHTILE_HF_STEP_IN_GRAPH", in_graph)
    backend("triton")
    torch._dynamo.reset()
    ours, _ = _models(family)
    ours = ours.half().cuda()
    ids, mask = (x.cuda() for x in _left_padded(batch=3, seqlen=9, pads=pads))
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True, cache_implementation="static")
    want = ours.generate(ids, disable_compile=True, **kwargs)
    got = ours.generate(ids, **kwargs)
    torch.cuda.synchronize()
    assert hasattr(ours, "_compiled_call")
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        scale = b.float().abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2 * scale, rtol=0, msg=f"step {step}")


@pytest.mark.parametrize("mode", ["1", "paged"])
@pytest.mark.parametrize("query_len", [1, 2])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sink", [False, True])
def test_cached_step_in_graph_matches_the_eager_path(monkeypatch, query_len, causal, mode, sink):
    """FLASHTILE_HF_STEP_IN_GRAPH=1: under torch.compile (fullgraph) a step with cached keys sorts each row's
    real keys to its front on the device and reads them through flash_attn_with_kvcache: the eager path's
    output (the mask read on the host, the real tokens packed) for left padding, right padding and holes; "paged":
    the cache read in place through a block table of one-row pages instead of gathered. With attention sinks
    (gpt-oss's s_aux) too: the output rescaled from the lse the kvcache call returns."""
    monkeypatch.setenv("FLASHTILE_HF_STEP_IN_GRAPH", mode)
    torch._dynamo.reset()
    module = _Attention()
    module.is_causal = causal
    q = torch.randn(3, 4, query_len, 16, dtype=torch.float64)
    k, v = torch.randn(3, 2, 12, 16, dtype=torch.float64), torch.randn(3, 2, 12, 16, dtype=torch.float64)
    extra = {"s_aux": torch.randn(4, dtype=torch.float64)} if sink else {}
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["block_table"])
        return flash_attn_with_kvcache(*args, **kwargs)

    monkeypatch.setattr(integration, "flash_attn_with_kvcache", counted)
    masks = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1],   # left padded
                          [1, 1, 1, 1, 1, 0, 0, 0, 1, 1],   # a right-padded prompt, then new tokens: a hole
                          [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]])  # holes
    query_holes = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 0],  # padding among the queries: 0 rows, the real
                                [1, 1, 1, 0, 1, 1, 1, 1, 0, 1],  # queries each on its own key
                                [1, 1, 1, 1, 1, 1, 1, 1, 1, 0]])
    step = torch.compile(flashtile_attention_forward, backend="aot_eager", fullgraph=True)
    for mask in (masks, query_holes):
        want, _ = flashtile_attention_forward(module, q, k, v, mask, **extra)
        got, _ = step(module, q, k, v, mask, **extra)
        torch.testing.assert_close(got, want)
        # the same step as a static cache's slot codes: 12 slots, the queries at slots 10 - query_len to 9
        codes = flashtile_mask(3, query_len, 12, torch.tensor(10 - query_len), attention_mask=mask.bool())
        for attention in (step, flashtile_attention_forward):
            got, _ = attention(module, q, k, v, codes, **extra)
            torch.testing.assert_close(got, want)
    assert calls and all((table is not None) == (mode == "paged") for table in calls)


def test_static_cache_slot_codes():
    """flashtile_mask for a static cache layer (its query offset a tensor): one int8 code per cache slot, the
    same shape every step; given back as bool (transformers does so inside the model), the same codes."""
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    codes = flashtile_mask(2, 2, 9, torch.tensor(4), attention_mask=mask)
    assert codes.dtype == torch.int8 and codes.shape == (2, 9)
    assert codes.tolist() == [[0, 1, 1, 1, 3, 0, 2, 2, 2], [1, 1, 1, 1, 3, 3, 2, 2, 2]]
    assert torch.equal(flashtile_mask(2, 2, 9, torch.tensor(4), attention_mask=codes.bool()), codes)
    # a full cache: no unused slot
    assert flashtile_mask(2, 2, 6, torch.tensor(4), attention_mask=mask).tolist() == [[0, 1, 1, 1, 3, 0],
                                                                                        [1, 1, 1, 1, 3, 3]]
    # no mask: every token seen is real
    assert flashtile_mask(2, 2, 7, torch.tensor(3), attention_mask=None).tolist() == [[1, 1, 1, 3, 3, 2, 2]] * 2
    # an int offset (a dynamic cache, a static cache's prefill, an encoder, cross-attention): transformers' flash mask
    assert torch.equal(flashtile_mask(2, 2, 6, 4, attention_mask=mask), mask)
    assert flashtile_mask(2, 2, 6, 4, attention_mask=torch.ones(2, 6, dtype=torch.bool)) is None
    assert flashtile_mask(2, 2, 6, 4, attention_mask=None) is None
    assert flashtile_mask(2, 3, 10, 0, attention_mask=None) is None  # cross-attention to 10 encoder tokens
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    assert flashtile_mask(2, 3, 10, 0, mask_function=bidirectional_mask_function, attention_mask=None) is None
    # a causal first call with more keys than queries: a static cache's prefill without a mask, 3 slots written
    codes = flashtile_mask(2, 3, 6, 0, mask_function=causal_mask_function, attention_mask=None)
    assert codes.tolist() == [[3, 3, 3, 2, 2, 2]] * 2
    assert flashtile_mask(2, 3, 3, 0, mask_function=causal_mask_function, attention_mask=None) is None


def _bart_models():
    """A tiny Bart as (flashtile model, eager model) with the same weights."""
    register()
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, init_std=0.3)
    torch.manual_seed(0)
    cls = transformers.BartForConditionalGeneration
    ours = cls._from_config(copy.deepcopy(config), attn_implementation="flashtile").eval()
    eager = cls._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    eager.load_state_dict(ours.state_dict())
    return ours, eager


@pytest.mark.parametrize("decoder_len", [1, 3, 12], ids=["one query", "three", "more queries than encoder tokens"])
def test_cross_attention_to_a_right_padded_encoder_matches_eager(decoder_len):
    """Bart with the tokenizer's right padding on the encoder: the cross-attention mask is the encoder's, of its
    keys alone, and every decoder query is real (read as the mask's last columns, the padded row's queries came
    out 0; with more decoder than encoder tokens the call raised)."""
    ours, eager = _bart_models()
    encoder_ids, decoder_ids = torch.randint(3, VOCAB, (2, 8)), torch.randint(3, VOCAB, (2, decoder_len))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        got = ours(input_ids=encoder_ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        want = eager(input_ids=encoder_ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for model in (ours, eager):
        model.generation_config.pad_token_id = 1
    generated = [model.generate(encoder_ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
                 for model in (ours, eager)]
    assert torch.equal(*generated)


def test_encoder_decoder_cross_attention_matches_eager():
    """Bart: the encoder, the decoder's causal attention and its cross-attention to more encoder tokens than
    decoder tokens (keys longer than the queries, an int offset: transformers' flash mask, not slot codes)."""
    ours, eager = _bart_models()
    encoder_ids, decoder_ids = torch.randint(3, VOCAB, (2, 10)), torch.randint(3, VOCAB, (2, 3))
    with torch.no_grad():
        got = ours(input_ids=encoder_ids, decoder_input_ids=decoder_ids).logits
        want = eager(input_ids=encoder_ids, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_encoder_decoder_static_cache_generation_matches_eager():
    """Bart's generate over a static cache: the decoder's first step gets back the slot codes of generate's own
    mask call as a boolean mask of every slot (the unwritten ones True). It attended to the unwritten slots
    (other tokens than eager's) until flashtile_mask took such a mask at an int offset as a static prefill's."""
    ours, eager = _bart_models()
    for model in (ours, eager):
        model.generation_config.pad_token_id = 1
    encoder_ids = torch.randint(3, VOCAB, (2, 8))
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", output_scores=True,
              return_dict_in_generate=True)
    got, want = ours.generate(encoder_ids, **kw), eager.generate(encoder_ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.scores[0], want.scores[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prefill_mask", [True, False], ids=["prefill with its mask", "no mask at all"])
def test_static_cache_step_without_a_mask_attends_to_the_tokens_seen(prefill_mask):
    """Steps over a static cache without an attention_mask: the keys are the whole preallocated cache, and only
    the slots written so far are attended to (before flashtile_mask, the unused slots were read too; a prefill
    without a mask read them until flashtile_mask took a causal first call with more keys than queries for a
    static cache's prefill)."""
    ours, eager = _models("llama")
    ids = torch.randint(1, VOCAB, (2, 7))
    logits = []
    for model in (ours, eager):
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        mask = {"attention_mask": torch.ones_like(ids)} if prefill_mask else {}
        with torch.no_grad():
            prefill = model(ids, past_key_values=cache, use_cache=True, **mask).logits
            chunk = model(ids[:, :3], past_key_values=cache, use_cache=True).logits
            step = model(ids[:, :1], past_key_values=cache, use_cache=True).logits
        logits.append((prefill, chunk, step))
    for got, want in zip(*logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_static_sliding_window_layers_without_a_mask_attend_to_the_tokens_seen(family):
    """A static cache's sliding-window layers before they fill (their query offset stays an int) called without
    an attention_mask: only the slots written are attended to (they read the unwritten ones: logits 8 off)."""
    ours, eager = _models(family)
    ids = torch.randint(1, VOCAB, (2, 3))
    logits = []
    for model in (ours, eager):
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            steps = [model(ids, past_key_values=cache, use_cache=True).logits]
            steps += [model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits for i in range(2)]
        logits.append(steps)
    for got, want in zip(*logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_static_sliding_window_steps_without_a_mask_compile_without_graph_breaks():
    """The same steps in a loop compiled by hand (not generate: it passes masks): eager attention's logits, and
    from torch 2.13 no graph break at the mask function's question (asked at trace time)."""
    ours, eager = _models("mistral")
    ids = torch.randint(1, VOCAB, (2, 3))
    logits = []
    for model in (ours, eager):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        step = torch.compile(model.forward, backend="aot_eager")
        with torch.no_grad():
            steps = [model(ids, past_key_values=cache, use_cache=True).logits]
            steps += [step(ids[:, i % 3:i % 3 + 1], past_key_values=cache, use_cache=True,
                           cache_position=torch.tensor([3 + i])).logits for i in range(8)]  # past the window (6)
        if integration._ANSWER_AT_TRACE_TIME:
            assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
        logits.append(steps)
    for got, want in zip(*logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bert_and_gpt2_cross_attention_to_a_right_padded_encoder():
    """Cross-attention layers without is_decoder (BERT's BertCrossAttention, GPT-2's is_cross_attention): every
    decoder query is real, whatever padding ends the encoder's rows."""
    register()
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, max_position_embeddings=32, is_decoder=True, add_cross_attention=True)
    decoders = {"bert": transformers.BertConfig(**common),
                "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=32,
                                                add_cross_attention=True, bos_token_id=1, eos_token_id=2)}
    encoder_config = transformers.BertConfig(**{**common, "is_decoder": False, "add_cross_attention": False})
    for name, decoder_config in decoders.items():
        config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(encoder_config, decoder_config)
        torch.manual_seed(0)
        ours = transformers.EncoderDecoderModel(config=copy.deepcopy(config))
        ours.set_attn_implementation("flashtile")
        eager = transformers.EncoderDecoderModel(config=copy.deepcopy(config))
        eager.set_attn_implementation("eager")
        eager.load_state_dict(ours.state_dict())
        encoder_ids, decoder_ids = torch.randint(3, VOCAB, (2, 8)), torch.randint(3, VOCAB, (2, 3))
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 5:] = 0
        with torch.no_grad():
            got, want = (model.eval()(input_ids=encoder_ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
                         for model in (ours, eager))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("layout", ["head dim strided", "batch stride", "pitches differ"])
def test_paged_step_falls_back_to_the_gather_where_pages_cannot_serve(layout):
    """FLASHTILE_HF_STEP_IN_GRAPH=paged reads the cache in place as one-row pages; caches that cannot be read so (a
    head dim that is not contiguous, a batch stride that is not a whole number of position strides, keys and values
    of different pitches) take the gather instead: the same output, no error."""
    batch, length, heads, dim = 3, 10, 2, 8
    q = torch.randn(batch, 2, 4, dim, dtype=torch.float64)
    big = torch.randn(batch, length, heads, 2 * dim, dtype=torch.float64)
    k, v = big[..., :dim].contiguous(), big[..., dim:].contiguous()
    if layout == "head dim strided":
        k, v = big[..., ::2], big[..., 1::2]
    elif layout == "batch stride":
        raw = torch.randn(batch * (length * heads * dim + 3), dtype=torch.float64)
        k = raw.as_strided((batch, length, heads, dim), (length * heads * dim + 3, heads * dim, dim, 1))
    else:
        k = torch.randn(batch, 2 * length, heads, dim, dtype=torch.float64)[:, :length]
    real = torch.rand(batch, 8, generator=torch.Generator().manual_seed(0)) < 0.7
    real[:, -2:] = True
    options = dict(dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0, sink=None)
    gathered = integration._cached_step_in_graph(q, k, v, real, real[:, -2:], options, paged=False)
    paged = integration._cached_step_in_graph(q, k, v, real, real[:, -2:], options, paged=True)
    assert torch.equal(paged, gathered)


def test_pool_pitch_refuses_block_tables_past_int32():
    """A paged step's block table holds int32 rows: a cache whose last row lies past 2**31 is gathered instead."""
    k = torch.empty_strided((2, 8, 1, 4), (2**33, 4, 4, 1), device="meta")  # a pitch of 2**31 rows
    assert integration._pool_pitch(k, k, 2, 8) is None
    assert integration._pool_pitch(k[:1], k[:1], 1, 8) is not None  # one entry: its rows from 0


def test_cached_step_with_gradients_keeps_the_packed_path(monkeypatch):
    """flash_attn_with_kvcache has no backward: a compiled step over cached keys that needs gradients (prefix
    tuning, say) keeps the varlen path and its gradients."""
    monkeypatch.setenv("FLASHTILE_HF_STEP_IN_GRAPH", "1")
    torch._dynamo.reset()
    q = torch.randn(2, 4, 2, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 9, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 9, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])
    compiled = torch.compile(flashtile_attention_forward, backend="aot_eager")
    compiled(_Attention(), q, k, v, mask)[0].sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    flashtile_attention_forward(_Attention(), q, k, v, mask)[0].sum().backward()
    for got, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, x.grad)


def test_padded_step_under_inductor_with_dynamic_shapes():
    """torch.compile(dynamic=True) with inductor over padded steps of growing masks (the mask read on the host,
    a graph break): the eager path's output. Building the query bounds after that break lost query_len's symbol
    in inductor's code, a NameError at run time."""
    torch._dynamo.reset()
    step = torch.compile(flashtile_attention_forward, backend="inductor", dynamic=True)
    for length in (6, 7, 9):
        q = torch.randn(2, 4, 1, 16, dtype=torch.float64)
        k, v = torch.randn(2, 2, 16, 16, dtype=torch.float64), torch.randn(2, 2, 16, 16, dtype=torch.float64)
        mask = torch.ones(2, length, dtype=torch.long)
        mask[0, :2] = 0
        got, _ = step(_Attention(), q, k, v, mask)
        want, _ = flashtile_attention_forward(_Attention(), q, k, v, mask)
        torch.testing.assert_close(got, want)


def test_static_cache_without_padding_reads_the_cache_in_place(calls):
    """A static cache is longer than the tokens so far, so transformers passes a mask with every key real: the
    cache's first keys go to flash_attn_func as they are (views), with no packed copies; eager's tokens."""
    ours, eager = _models("llama")
    ids = torch.randint(1, VOCAB, (2, 7))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = ours.generate(ids, cache_implementation="static", **kwargs)
    assert calls["flash_attn_varlen_func"] == 0 and calls["flash_attn_func"] == 2 * 5  # layers x steps
    assert torch.equal(got, eager.generate(ids, **kwargs))


class _Attention(torch.nn.Module):
    is_causal = True


def _qkv(batch=1, seqlen=6):
    return [torch.randn(batch, 2, seqlen, 8) for _ in range(3)]


@pytest.mark.parametrize("bad, message", [
    (dict(attention_mask=torch.zeros(1, 1, 6, 6)), "2-D padding mask"),
    (dict(output_attentions=True), "output_attentions"),
    (dict(cu_seq_lens_q=torch.tensor([0, 6], dtype=torch.int32)), "without cu_seq_lens_k, max_length_q"),
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), "paged"),
    (dict(attention_mask=torch.ones(1, 9, dtype=torch.bool)), "attention_mask covers 9 keys"),
])
def test_what_flashtile_cannot_honour_raises(bad, message):
    q, k, v = _qkv()
    kwargs = dict(attention_mask=None) | bad
    with pytest.raises((ValueError, NotImplementedError), match=message):
        flashtile_attention_forward(_Attention(), q, k, v, **kwargs)


def test_model_without_flash_support_is_refused():
    register()

    class NoFlash(transformers.LlamaForCausalLM):
        _supports_flash_attn = False

    config = _config("llama")[1]
    with pytest.raises(ValueError, match="_supports_flash_attn"):
        NoFlash._from_config(config, attn_implementation="flashtile")


def test_smaller_value_head_dim_is_padded_and_cropped():
    q, k = _qkv()[:2]
    v = torch.randn(1, 2, 6, 5)
    out, weights = flashtile_attention_forward(_Attention(), q, k, v, None)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    assert weights is None
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_batched_prefill_with_a_position_gap_stays_one_sequence_a_row(family, calls):
    """With a cache (use_cache=True, a generation's prefill), transformers' eager mask does not split rows at
    restarting positions, nor does its flash-attention path in a batch of several rows: neither does flashtile,
    also where the model does not pass use_cache to its layers (Gemma 2). Without a cache the eager mask splits
    them, and so does flashtile where the layers are told (Llama)."""
    ours, eager = _models(family)
    ids = torch.randint(1, VOCAB, (2, 12))
    positions = torch.arange(12).expand(2, 12).clone()
    positions[:, 6:] += 4
    with torch.no_grad():
        for use_cache in (True, False) if family == "llama" else (True,):
            got = ours(ids, position_ids=positions, use_cache=use_cache).logits
            want = eager(ids, position_ids=positions, use_cache=use_cache).logits
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"use_cache={use_cache}")


def test_training_step_traces_whole_under_fullgraph_compile(calls):
    """A training step without a mask (the model's own position_ids, shared by the rows) compiles with
    fullgraph=True (aot_eager: traced through flashtile's ops) and gives eager's loss."""
    ours, _ = _models("llama")
    ours.train()
    ids = torch.randint(1, VOCAB, (2, 16))
    want = ours(input_ids=ids, labels=ids, use_cache=False).loss
    torch._dynamo.reset()
    got = torch.compile(ours, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=ids, use_cache=False).loss
    got.backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
