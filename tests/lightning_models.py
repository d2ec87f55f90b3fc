"""Small LightningModules and data shared by the callback tests."""
import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import npugraph_train as ngt


@ngt.graph_safe
class Block(nn.Module):
    def __init__(self, width: int, dropout: float = 0.0):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.norm(self.lin(x))))


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 8, depth: int = 2, dropout: float = 0.0, lr: float = 0.05):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList([Block(width, dropout) for _ in range(depth)])
        self.head = nn.Linear(width, 1)
        self.lr = lr

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def loaders(n: int = 70, batch_size: int = 8, seed: int = 123):
    """Train loader with a short last batch (70 = 8 * 8 + 6) and a validation loader."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(n, 1, generator=g)
    train = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
    val = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=batch_size)
    return train, val


def trainer(callbacks=(), max_steps: int = 36, **kwargs) -> pl.Trainer:
    defaults = dict(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, val_check_interval=5,
                    num_sanity_val_steps=0, deterministic=True)
    defaults.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **defaults)


def fit(model_kwargs=None, callbacks=(), seed: int = 0, **trainer_kwargs):
    torch.manual_seed(seed)
    model = Regressor(**(model_kwargs or {}))
    train, val = loaders()
    t = trainer(callbacks, **trainer_kwargs)
    t.fit(model, train, val)
    return model, t
