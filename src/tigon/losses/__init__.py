"""Chunked post-training losses: the logits are never formed for the whole batch."""

from tigon.losses.distillation import TigonFusedLinearJSD, TigonJSD, fused_linear_jsd, jsd_loss
from tigon.losses.policy import TigonGRPOLoss, grpo_loss, per_token_logps
from tigon.losses.preference import (
    TigonCPOLoss,
    TigonDPOLoss,
    TigonKTOLoss,
    TigonORPOLoss,
    TigonSimPOLoss,
    cpo_loss,
    dpo_loss,
    kto_loss,
    orpo_loss,
    simpo_loss,
)

__all__ = ["TigonCPOLoss", "TigonDPOLoss", "TigonFusedLinearJSD", "TigonGRPOLoss", "TigonJSD", "TigonKTOLoss",
           "TigonORPOLoss", "TigonSimPOLoss", "cpo_loss", "dpo_loss", "fused_linear_jsd", "grpo_loss", "jsd_loss",
           "kto_loss", "orpo_loss", "per_token_logps", "simpo_loss"]
