"""Model engines behind one interface (`base.ModelEngine`): FSDP2 and Megatron-core."""
