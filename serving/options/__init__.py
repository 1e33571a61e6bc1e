"""What `petal serve` is told: the options in frozen groups (`config`), the files the flags name (`config_files`),
the text protos those files are read into, and the flags of tensorflow_model_server that Petal takes without
implementing. The flags are parsed above, in serving/process/flags.py: parsing checks what they ask for against
the rooms that use it (the memory budget, the model config's version labels), which import these options."""
