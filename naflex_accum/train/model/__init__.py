"""What trains: ``finetune`` (``--pretrained``, the locks), ``compile`` (``--torchcompile``), ``fsdp`` (``--fsdp``).

Invariant: the model reaching the optimizer is the one the flags describe: weights load whole or not at all."""
