"""Small pieces every layer may use, none of which knows a NIC: lazy package attributes, task groups that are a
context manager's own, the text and JSON bounds for what strangers send, and the files and directories only we may
write."""
