"""Tiny Hugging Face models built from configs (no downloads), shared by the integration tests."""

import torch
import transformers

VOCAB, SEQ = 64, 8


def tiny(kind):
    """(model, example maker) of a 1-layer model 16 wide; examples are dicts of integer tensors."""
    torch.manual_seed(0)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
            )
        )
        return model, lambda ids, g: {"input_ids": ids, "labels": ids}
    if kind == "bert":
        model = transformers.BertForSequenceClassification(
            transformers.BertConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=32,
                max_position_embeddings=16,
                num_labels=3,
            )
        )
        return model, lambda ids, g: {"input_ids": ids, "labels": torch.randint(0, 3, (), generator=g)}
    model = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=VOCAB,
            d_model=16,
            d_kv=8,
            d_ff=32,
            num_layers=1,
            num_decoder_layers=1,
            num_heads=2,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )
    return model, lambda ids, g: {"input_ids": ids, "labels": ids.flip(0)}


class Examples(torch.utils.data.Dataset):
    def __init__(self, make, n=16):
        self.make, self.n = make, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return self.make(torch.randint(2, VOCAB, (SEQ,), generator=g), g)
