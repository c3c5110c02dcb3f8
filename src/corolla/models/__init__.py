"""What a block is: one folder per family (`llama`, `mixtral`, `falcon`, `bloom`) with its config rules,
block and weight names; the `registry`; partial weight `loading`; `quantization`, `lora` and `tensor_parallel`.
Never imports networking."""
