"""A small transformer encoder classifier in plain torch, its forward under CUDA autocast."""
import torch
import torch.nn as nn

import config


class SequenceClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(config.VOCAB, config.D_MODEL, padding_idx=config.PAD)
        self.position = nn.Parameter(0.02 * torch.randn(1, config.SEQ_LEN, config.D_MODEL))
        layer = nn.TransformerEncoderLayer(config.D_MODEL, config.N_HEADS, config.FF_DIM,
                                           dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, config.N_LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(config.D_MODEL)
        self.head = nn.Linear(config.D_MODEL, config.N_CLASSES)

    @torch.cuda.amp.autocast()
    def forward(self, ids, mask):
        h = self.embed(ids) + self.position[:, :ids.size(1)]
        h = self.encoder(h, src_key_padding_mask=~mask)
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1)
        return self.head(self.norm(pooled))
