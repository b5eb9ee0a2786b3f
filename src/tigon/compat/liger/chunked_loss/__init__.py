"""``liger_kernel.chunked_loss`` on tigon: Liger-Kernel 0.8.5's fused-linear post-training loss
modules with Liger's constructor arguments and forward signatures, running ``tigon.losses``
(see ``tigon.compat.liger.chunked_loss.functional`` for what each returns). Note Liger's
argument orders, kept here: the preference losses (DPO, ORPO, CPO, SimPO) take the head's
weight first, ``forward(lin_weight, _input, target, ...)``; KTO and GRPO take the hidden states
first, ``forward(_input, lin_weight, ...)``."""

from torch import nn

from tigon.compat.liger.chunked_loss.functional import (
    LigerFusedLinearCPOFunction,
    LigerFusedLinearDPOFunction,
    LigerFusedLinearGRPOFunction,
    LigerFusedLinearJSDFunction,
    LigerFusedLinearKTOFunction,
    LigerFusedLinearORPOFunction,
    LigerFusedLinearSimPOFunction,
    check_dpo_options,
    check_grpo_options,
)
from tigon.compat.liger.names import not_provided_getattr


class LigerFusedLinearDPOLoss(nn.Module):
    """Liger's DPO loss module: ``forward(lin_weight, _input, target, bias=None, ref_input=None,
    ref_weight=None, ref_bias=None)`` -> (loss, metrics); see LigerFusedLinearDPOFunction."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, compute_nll_loss: bool = False,
                 compiled: bool = True, use_ref_model: bool = True, average_log_prob: bool = False,
                 chunk_size: int = 1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 discopop_tau: float = 0.05):
        super().__init__()
        check_dpo_options(loss_type, label_smoothing)
        self.ignore_index, self.beta, self.alpha, self.compute_nll_loss = ignore_index, beta, alpha, compute_nll_loss
        self.compiled, self.use_ref_model, self.average_log_prob = compiled, use_ref_model, average_log_prob
        self.chunk_size, self.loss_type, self.label_smoothing = chunk_size, loss_type, label_smoothing
        self.discopop_tau = discopop_tau

    def forward(self, lin_weight, _input, target, bias=None, ref_input=None, ref_weight=None, ref_bias=None):
        return LigerFusedLinearDPOFunction.apply(
            _input, lin_weight, target, bias, ref_input, ref_weight, ref_bias, self.ignore_index, self.beta,
            self.compute_nll_loss, self.compiled, self.use_ref_model, self.average_log_prob, self.chunk_size,
            self.loss_type, self.label_smoothing, self.discopop_tau, self.alpha)


class LigerFusedLinearORPOLoss(nn.Module):
    """Liger's ORPO loss module: ``forward(lin_weight, _input, target, bias=None, nll_target=None)``
    -> (loss, metrics); see LigerFusedLinearORPOFunction."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, compute_nll_loss: bool = True,
                 compiled: bool = True, chunk_size: int = 1):
        super().__init__()
        self.ignore_index, self.beta, self.compute_nll_loss = ignore_index, beta, compute_nll_loss
        self.compiled, self.chunk_size = compiled, chunk_size

    def forward(self, lin_weight, _input, target, bias=None, nll_target=None):
        return LigerFusedLinearORPOFunction.apply(_input, lin_weight, target, bias, self.ignore_index, self.beta,
                                                  self.compute_nll_loss, nll_target, self.compiled, self.chunk_size)


class LigerFusedLinearCPOLoss(nn.Module):
    """Liger's CPO loss module: ``forward(lin_weight, _input, target, bias=None)`` -> (loss,
    metrics); see LigerFusedLinearCPOFunction."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
                 compute_nll_loss: bool = True, compiled: bool = True, average_log_prob: bool = False,
                 chunk_size: int = 1):
        super().__init__()
        self.ignore_index, self.beta, self.alpha, self.label_smoothing = ignore_index, beta, alpha, label_smoothing
        self.compute_nll_loss, self.compiled, self.average_log_prob = compute_nll_loss, compiled, average_log_prob
        self.chunk_size = chunk_size

    def forward(self, lin_weight, _input, target, bias=None):
        return LigerFusedLinearCPOFunction.apply(_input, lin_weight, target, bias, self.ignore_index, self.beta,
                                                 self.alpha, self.label_smoothing, self.compute_nll_loss,
                                                 self.compiled, self.average_log_prob, self.chunk_size)


class LigerFusedLinearSimPOLoss(nn.Module):
    """Liger's SimPO loss module: ``forward(lin_weight, _input, target, bias=None)`` -> (loss,
    metrics); see LigerFusedLinearSimPOFunction."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
                 compute_nll_loss: bool = True, compiled: bool = True, gamma: float = 0.5, chunk_size: int = 1):
        super().__init__()
        self.ignore_index, self.beta, self.alpha, self.label_smoothing = ignore_index, beta, alpha, label_smoothing
        self.compute_nll_loss, self.compiled = compute_nll_loss, compiled
        self.gamma, self.chunk_size = gamma, chunk_size

    def forward(self, lin_weight, _input, target, bias=None):
        return LigerFusedLinearSimPOFunction.apply(_input, lin_weight, target, bias, self.ignore_index, self.beta,
                                                   self.alpha, self.label_smoothing, self.compute_nll_loss,
                                                   self.compiled, self.gamma, self.chunk_size)


class LigerFusedLinearKTOLoss(nn.Module):
    """Liger's KTO loss module: ``forward(_input, lin_weight, target, bias=None,
    preference_labels=None, ref_input=None, ref_weight=None, ref_bias=None, kl=None)`` (the hidden
    states first) -> (loss, metrics); see LigerFusedLinearKTOFunction."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, compiled: bool = True, use_ref_model: bool = False,
                 average_log_prob: bool = False, chunk_size: int = 1):
        super().__init__()
        self.ignore_index, self.beta, self.compiled, self.use_ref_model = ignore_index, beta, compiled, use_ref_model
        self.average_log_prob, self.chunk_size = average_log_prob, chunk_size

    def forward(self, _input, lin_weight, target, bias=None, preference_labels=None, ref_input=None, ref_weight=None,
                ref_bias=None, kl=None):
        return LigerFusedLinearKTOFunction.apply(_input, lin_weight, target, preference_labels, bias, ref_input,
                                                 ref_weight, ref_bias, kl, self.ignore_index, self.beta, self.compiled,
                                                 self.use_ref_model, self.average_log_prob, self.chunk_size)


class LigerFusedLinearJSDLoss(nn.Module):
    """Liger's JSD distillation loss module: ``forward(student_input, student_weight,
    teacher_input, teacher_weight, true_labels, student_bias=None, teacher_bias=None)``; see
    LigerFusedLinearJSDFunction."""

    def __init__(self, weight_hard_loss: float = 0.5, weight_soft_loss: float = 0.5, beta: float = 0.5,
                 ignore_index: int = -100, temperature: float = 1.0, compiled: bool = True, chunk_size: int = 1024,
                 return_soft_hard_loss: bool = False):
        super().__init__()
        if temperature == 0:
            raise ValueError("temperature cannot be 0")
        self.weight_hard_loss, self.weight_soft_loss, self.beta = weight_hard_loss, weight_soft_loss, beta
        self.ignore_index, self.temperature, self.compiled = ignore_index, temperature, compiled
        self.chunk_size, self.return_soft_hard_loss = chunk_size, return_soft_hard_loss

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias=None,
                teacher_bias=None):
        return LigerFusedLinearJSDFunction.apply(student_input, student_weight, teacher_input, teacher_weight,
                                                 true_labels, student_bias, teacher_bias, self.weight_hard_loss,
                                                 self.weight_soft_loss, self.beta, self.ignore_index, self.temperature,
                                                 self.compiled, self.chunk_size, self.return_soft_hard_loss)


class LigerFusedLinearGRPOLoss(nn.Module):
    """Liger's GRPO loss module: ``forward(_input, lin_weight, selected_token_ids, attention_mask,
    advantages, bias=None, ref_per_token_logps=None, old_per_token_logps=None, ref_input=None,
    ref_weight=None, ref_bias=None, vllm_is_ratio=None, num_items_in_batch=None)`` -> (loss,
    metrics); see LigerFusedLinearGRPOFunction."""

    def __init__(self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
                 epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
                 max_completion_length: int | None = None, importance_sampling_level: str = "token",
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
                 delta: float | None = None, use_bias_correction_kl: bool = False, vespo_k_pos: float = 2.0,
                 vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0):
        super().__init__()
        check_grpo_options(loss_type, importance_sampling_level)
        for name, value in (("sapo_temperature_pos", sapo_temperature_pos),
                            ("sapo_temperature_neg", sapo_temperature_neg)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if delta is not None and not delta > 0:
            raise ValueError(f"delta must be positive, got {delta!r}")
        self.beta, self.compiled, self.use_ref_model, self.chunk_size = beta, compiled, use_ref_model, chunk_size
        self.epsilon_low, self.epsilon_high, self.loss_type = epsilon_low, epsilon_high, loss_type
        self.max_completion_length, self.importance_sampling_level = max_completion_length, importance_sampling_level
        self.sapo_temperature_pos, self.sapo_temperature_neg = sapo_temperature_pos, sapo_temperature_neg
        self.temperature, self.delta, self.use_bias_correction_kl = temperature, delta, use_bias_correction_kl
        self.vespo_k_pos, self.vespo_lambda_pos = vespo_k_pos, vespo_lambda_pos
        self.vespo_k_neg, self.vespo_lambda_neg = vespo_k_neg, vespo_lambda_neg

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
                vllm_is_ratio=None, num_items_in_batch=None):
        return LigerFusedLinearGRPOFunction.apply(
            _input, lin_weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
            old_per_token_logps, ref_input, ref_weight, ref_bias, self.beta, self.epsilon_low, self.epsilon_high,
            self.loss_type, self.max_completion_length, self.importance_sampling_level, self.sapo_temperature_pos,
            self.sapo_temperature_neg, self.temperature, self.compiled, self.use_ref_model, self.chunk_size,
            vllm_is_ratio, self.delta, self.use_bias_correction_kl, self.vespo_k_pos, self.vespo_lambda_pos,
            self.vespo_k_neg, self.vespo_lambda_neg, num_items_in_batch)


__all__ = ["LigerFusedLinearCPOLoss", "LigerFusedLinearDPOLoss", "LigerFusedLinearGRPOLoss", "LigerFusedLinearJSDLoss",
           "LigerFusedLinearKTOLoss", "LigerFusedLinearORPOLoss", "LigerFusedLinearSimPOLoss"]
__getattr__ = not_provided_getattr(__name__, "liger_kernel.chunked_loss")
