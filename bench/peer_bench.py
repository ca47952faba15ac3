"""(Copied unchanged from the team's shared/bench/peer_bench.py so it travels to the GPU machine.)

Held-out throughput benchmark for engines with vLLM's offline API (LLM, SamplingParams).

Usage: python peer_bench.py ENGINE SHAPE WORKLOAD [WORKLOAD ...]
  ENGINE   vllm | tokenmill | nanovllm | any importable module exposing LLM and SamplingParams
  SHAPE    qwen3-0.6b | llama3-8b   (random weights with the real architecture's shapes)
  WORKLOAD nano     256 seqs, in U[100,1024], out U[100,1024], T=0.6, eos ignored (nano-vllm's bench.py)
           uniform  1024 seqs, 512 in, 256 out, greedy, eos ignored
           big      1024 seqs, in U[100,1024], out U[100,1024], T=0.6, eos ignored
           sampling P4: 768 seqs sharing a 256-token prefix + U[100,700] own tokens, out U[64,640],
                    T=0.7 top_p=0.95 top_k=100 frequency/presence_penalty=0.05 repetition_penalty=1.05
           prefill  P5: 384 seqs, in U[1000,3000], out U[16,256], T=0.2
Prints one JSON row per workload (output tokens / wall seconds of the generate call) and appends
it to the file named by $RESULTS when that is set. Engines with vLLM's full API get random weights via
load_format="dummy" and token-id prompts (skip_tokenizer_init); nano-vllm gets random safetensors."""
import json, os, sys, time, importlib
from random import randint, seed

CONFIGS = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                        rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                        hidden_act="silu", torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645,
                        attention_bias=False),
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                       rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                       hidden_act="silu", torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001),
}


def model_dir(shape, with_weights):
    """A model folder: config.json, a stand-in tokenizer, and (optionally) random bf16 safetensors."""
    d = f"/tmp/models/{shape}" + ("-w" if with_weights else "")
    if os.path.exists(os.path.join(d, "config.json")):
        return d
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(CONFIGS[shape], f)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(1000)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>").save_pretrained(d)
    if with_weights:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = AutoConfig.from_pretrained(d)
        with torch.device("cuda"):
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        m.save_pretrained(d)
        del m
        torch.cuda.empty_cache()
    return d


def workload(name):
    """prompts (token-id lists), per-prompt output lengths, sampling settings shared by all."""
    seed(0)
    if name in ("nano", "big"):
        n = 256 if name == "nano" else 1024
        prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(n)]
        outs = [randint(100, 1024) for _ in range(n)]
        return prompts, outs, dict(temperature=0.6)
    if name == "uniform":
        prompts = [[randint(0, 10000) for _ in range(512)] for _ in range(1024)]
        return prompts, [256] * 1024, dict(temperature=0.0)
    if name == "sampling":
        prefix = [randint(0, 10000) for _ in range(256)]
        prompts = [prefix + [randint(0, 10000) for _ in range(randint(100, 700))] for _ in range(768)]
        outs = [randint(64, 640) for _ in range(768)]
        return prompts, outs, dict(temperature=0.7, top_p=0.95, top_k=100, frequency_penalty=0.05,
                                   presence_penalty=0.05, repetition_penalty=1.05)
    if name == "prefill":
        prompts = [[randint(0, 10000) for _ in range(randint(1000, 3000))] for _ in range(384)]
        outs = [randint(16, 256) for _ in range(384)]
        return prompts, outs, dict(temperature=0.2)
    raise SystemExit(f"unknown workload {name}")


def main():
    engine, shape, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    mod = importlib.import_module(engine)
    LLM, SamplingParams = mod.LLM, mod.SamplingParams
    t0 = time.time()
    if engine != "nanovllm":
        llm = LLM(model=model_dir(shape, False), load_format="dummy", skip_tokenizer_init=True,
                  max_model_len=4096, gpu_memory_utilization=0.9, seed=0)
        wrap = lambda p: [{"prompt_token_ids": x} for x in p]
        extra = dict(detokenize=False)
    else:
        llm = LLM(model_dir(shape, True), max_model_len=4096, gpu_memory_utilization=0.9)
        wrap = lambda p: p
        extra = {}
        if hasattr(llm, "tokenizer"):
            llm.tokenizer.decode = lambda ids, **k: ""
    init_s = time.time() - t0
    llm.generate(wrap([[1, 2, 3, 4]] * 4), SamplingParams(max_tokens=8, ignore_eos=True, **extra), use_tqdm=False)
    for name in names:
        prompts, outs, settings = workload(name)
        sps = [SamplingParams(ignore_eos=True, max_tokens=o, **settings, **extra) for o in outs]
        t = time.time()
        res = llm.generate(wrap(prompts), sps, use_tqdm=False)
        dt = time.time() - t
        got = sum(len(r.outputs[0].token_ids) if hasattr(r, "outputs") else len(r["token_ids"]) for r in res)
        row = dict(engine=engine, version=getattr(mod, "__version__", "?"), shape=shape, workload=name,
                   seqs=len(prompts), in_tokens=sum(map(len, prompts)), out_tokens=sum(outs), got_tokens=got,
                   seconds=round(dt, 2), out_tok_s=round(sum(outs) / dt, 1), init_s=round(init_s, 1))
        print(json.dumps(row), flush=True)
        if os.environ.get("RESULTS"):
            with open(os.environ["RESULTS"], "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
