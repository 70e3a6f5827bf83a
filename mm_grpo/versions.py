"""Versions of the libraries the code must read differently: transformers 5 (the default
environment's pin) against 4.x (MindSpeed-MM's 4.57), for the tokenizers every family loads or builds."""


def transformers_5() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5
