"""A transformers Trainer script (written for castwise's tests: a tiny Llama from a config, CPU,
random tokens). The precision is the Trainer's (``--bf16``: TrainingArguments(bf16=True), which
the Trainer runs through Accelerate's autocast)."""

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (8, 12), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, max_steps=2, per_device_train_batch_size=4, bf16=args.bf16, use_cpu=True,
            report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
        )  # fmt: skip
        result = Trainer(model=model, args=targs, train_dataset=Tokens()).train()
    print(f"train loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
