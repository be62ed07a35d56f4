"""The test suite, by what it exercises (`python -m pytest` runs it all):

- unit/: pure code without an emulator process: codecs and layouts, ring arithmetic, planners, parsers, summaries;
- emulator/: the emulated NIC's device side: firmware, data path, wire, its processes, forged and fuzzed input;
- driver/: the driver, the PCI seams and the verbs against emulated NICs in this process, and what runs on them
  (the scheduler's batches);
- tools/: the command line and the perftest / nccl-tests engines, bench and lat servers in this process;
- system/: several processes or hosts: SSH peers, network namespaces, collectives, servers as processes, other
  local users, the installed package;
- support/: what the tests share; test_layers.py: the package's floors and the rules between them.
"""
