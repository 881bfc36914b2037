"""Neural-network modules and functions, named as in torch.nn."""

from . import functional, init, utils
from .modules import (GELU, BCELoss, BatchNorm1d, BatchNorm2d, BCEWithLogitsLoss, CrossEntropyLoss, Dropout, Embedding,
                      Flatten, GroupNorm, Identity, L1Loss, LayerNorm, Linear, Module, ModuleDict, ModuleList, MSELoss,
                      NLLLoss, Parameter, ReLU, RMSNorm, Sequential, SiLU, Softmax, Tanh, is_narrow, narrow_parameter,
                      no_init)
from .modules import Conv1d, Conv2d
from .attention import MultiheadAttention
from .weights import load_safetensors, save_safetensors

__all__ = ["functional", "init", "utils", "Module", "Parameter", "Linear", "Embedding", "LayerNorm", "BatchNorm1d", "BatchNorm2d",
           "GroupNorm", "RMSNorm", "Conv1d", "Conv2d", "Dropout", "GELU",
           "ReLU", "Tanh", "SiLU", "Identity", "Softmax", "Flatten", "Sequential", "ModuleList", "ModuleDict",
           "CrossEntropyLoss", "MSELoss", "L1Loss", "NLLLoss", "BCELoss", "BCEWithLogitsLoss", "is_narrow",
           "narrow_parameter", "no_init", "save_safetensors", "load_safetensors",
           "MultiheadAttention"]
