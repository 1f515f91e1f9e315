"""A user's serving script: transformers' text-generation pipeline over a
batch of prompts (GPT-2 of 4 layers in float16, a word-level tokenizer built
in the script, 128-word prompts, 32 new tokens, greedy). The pipeline
slices generate()'s output one sequence at a time on the CPU.

    python -m gpumem.predict --memory 80G bench/torch/userjobs/pipeline_generate.py --batch-size {B}
"""
import argparse
import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, pipeline
from tokenizers import Tokenizer, models, pre_tokenizers

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=4)
args = p.parse_args()
vocab = {f"w{i}": i for i in range(1000)}
vocab["[UNK]"] = 1000
tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
tk.pre_tokenizer = pre_tokenizers.Whitespace()
tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[UNK]")
tok.padding_side = "left"
model = GPT2LMHeadModel(GPT2Config(n_layer=4, vocab_size=1001, n_positions=512)).half()
gen = pipeline("text-generation", model=model, tokenizer=tok, device=0, torch_dtype=torch.float16)
prompts = [" ".join(f"w{(i * 7 + j) % 1000}" for j in range(128)) for i in range(args.batch_size)]
out = gen(prompts, max_new_tokens=32, do_sample=False, batch_size=args.batch_size)
print(len(out))
