"""Neural-network modules and functions, named as in torch.nn."""

from . import functional, utils
from .modules import (GELU, CrossEntropyLoss, Dropout, Embedding, LayerNorm, Linear, Module, ModuleList, Parameter,
                      ReLU, Sequential, Tanh, no_init)
from .weights import load_safetensors, save_safetensors

__all__ = ["functional", "utils", "Module", "Parameter", "Linear", "Embedding", "LayerNorm", "Dropout", "GELU", "ReLU",
           "Tanh", "Sequential", "ModuleList", "CrossEntropyLoss", "no_init", "save_safetensors", "load_safetensors"]
