"""A LoRA fine-tune as HF Trainer and PEFT users write one: a 4-layer Llama
(hidden 512, 32,000-word vocabulary) with LoRA (r 8) on the attention's q
and v projections, bf16, gradient checkpointing, gradient accumulation 2,
cosine schedule, sequences of 256 tokens.

    python -m gpumem.predict --memory 79G bench/torch/userjobs/trainer_llama_lora.py --batch-size {B}
"""

import argparse
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

ap = argparse.ArgumentParser()
ap.add_argument("--batch-size", type=int, default=8)
ap.add_argument("--steps", type=int, default=20)
args = ap.parse_args()


class RandomTokens(Dataset):
    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        ids = torch.randint(0, 32000, (256,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


config = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4)
model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                            task_type="CAUSAL_LM"))
with tempfile.TemporaryDirectory() as out:
    training = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
                                 bf16=torch.cuda.is_available(), gradient_checkpointing=True,
                                 gradient_checkpointing_kwargs={"use_reentrant": False},
                                 gradient_accumulation_steps=2, lr_scheduler_type="cosine", warmup_steps=2,
                                 report_to=[], save_strategy="no", logging_steps=5, disable_tqdm=True)
    Trainer(model=model, args=training, train_dataset=RandomTokens()).train()
