"""Neural-network modules and functions, named as in torch.nn."""

from . import functional, init, utils
from .modules import (GELU, CrossEntropyLoss, Dropout, Embedding, Flatten, Identity, LayerNorm, Linear, Module,
                      ModuleDict, ModuleList, MSELoss, Parameter, ReLU, Sequential, SiLU, Softmax, Tanh, is_narrow,
                      narrow_parameter, no_init)
from .weights import load_safetensors, save_safetensors

__all__ = ["functional", "init", "utils", "Module", "Parameter", "Linear", "Embedding", "LayerNorm", "Dropout", "GELU",
           "ReLU", "Tanh", "SiLU", "Identity", "Softmax", "Flatten", "Sequential", "ModuleList", "ModuleDict",
           "CrossEntropyLoss", "MSELoss", "is_narrow", "narrow_parameter", "no_init", "save_safetensors", "load_safetensors"]
