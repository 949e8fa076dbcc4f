"""The diffusion's training loss and its one-step sampler, each wrapping the denoiser."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class GaussianDiffusionTrainer(nn.Module):
    def __init__(self, model, beta_1, beta_T, T):
        super().__init__()
        self.model = model
        self.register_buffer("betas", torch.linspace(beta_1, beta_T, T).double())
        alphas_bar = torch.cumprod(1.0 - self.betas, dim=0)
        self.register_buffer("sqrt_alphas_bar", torch.sqrt(alphas_bar).float())
        self.register_buffer("sqrt_one_minus_alphas_bar", torch.sqrt(1.0 - alphas_bar).float())

    def forward(self, x_0, noise, t):
        x_t = self.sqrt_alphas_bar[t][:, None] * x_0 + self.sqrt_one_minus_alphas_bar[t][:, None] * noise
        return F.mse_loss(self.model(x_t, t), noise, reduction="none")


class GaussianDiffusionSampler(nn.Module):
    def __init__(self, model, beta_1, beta_T, T):
        super().__init__()
        self.model = model
        self.T = T
        self.register_buffer("betas", torch.linspace(beta_1, beta_T, T).double())

    def forward(self, x_T):
        """The last step's estimate of x_0 from x_T: x_T less the noise the model sees."""
        t = torch.full((x_T.shape[0],), self.T - 1, dtype=torch.long, device=x_T.device)
        return x_T - self.betas[-1].float().sqrt() * self.model(x_T, t)
