"""(Copied unchanged from the team's shared/bench/embed_bench.py so it travels to the GPU machine.)

P6: embedding throughput of any engine with vLLM's pooling API (LLM(runner="pooling").embed).

Usage: python embed_bench.py ENGINE SHAPE     ENGINE vllm | tokenmill    SHAPE qwen3-embed-0.6b | bert-minilm
Random weights with the real shape (load_format="dummy"), token-id inputs, one timed llm.embed call
after a warm-up. qwen3-embed-0.6b: 16,384 inputs of U[8,384] tokens; bert-minilm: 65,536 inputs of
U[8,128] tokens. Figure = input tokens / wall seconds. Prints a JSON row; appends it to $RESULTS."""
import json, os, sys, time, importlib
from random import randint, seed

SHAPES = {
    "qwen3-embed-0.6b": (dict(architectures=["Qwen3Model"], model_type="qwen3", hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151669, tie_word_embeddings=True, rope_theta=1000000.0,
        max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu", torch_dtype="bfloat16",
        bos_token_id=151643, eos_token_id=151643, attention_bias=False), 16384, 384),
    "bert-minilm": (dict(architectures=["BertModel"], model_type="bert", hidden_size=384,
        intermediate_size=1536, num_hidden_layers=6, num_attention_heads=12, vocab_size=30522,
        max_position_embeddings=512, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12,
        pad_token_id=0, torch_dtype="float32"), 65536, 128),
}


def model_dir(shape):
    d = f"/tmp/models/{shape}"
    if not os.path.exists(f"{d}/config.json"):
        os.makedirs(d, exist_ok=True)
        json.dump(SHAPES[shape][0], open(f"{d}/config.json", "w"))
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(1000)}}
        tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>").save_pretrained(d)
    return d


def main():
    engine, shape = sys.argv[1], sys.argv[2]
    _, n, longest = SHAPES[shape]
    mod = importlib.import_module(engine)
    t0 = time.time()
    llm = mod.LLM(model=model_dir(shape), runner="pooling", load_format="dummy", dtype="bfloat16",
                  max_model_len=512, gpu_memory_utilization=0.9, seed=0)
    init_s = time.time() - t0
    seed(0)
    inputs = [{"prompt_token_ids": [randint(2, 10000) for _ in range(randint(8, longest))]} for _ in range(n)]
    llm.embed(inputs[:64], use_tqdm=False)
    t = time.time()
    out = llm.embed(inputs, use_tqdm=False)
    dt = time.time() - t
    tokens = sum(len(x["prompt_token_ids"]) for x in inputs)
    row = dict(engine=engine, version=getattr(mod, "__version__", "?"), shape=shape, workload="embed",
               inputs=n, in_tokens=tokens, dim=len(out[0].outputs.embedding), seconds=round(dt, 2),
               in_tok_s=round(tokens / dt, 1), init_s=round(init_s, 1))
    print(json.dumps(row), flush=True)
    if os.environ.get("RESULTS"):
        with open(os.environ["RESULTS"], "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
