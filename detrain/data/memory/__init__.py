"""Memory shared between the processes of a node: batches written once into shared memory and
recycled (``batch_memory``), the per-process decode cache, the ``cache=ram`` file (``ram_cache``,
``ram_cache_file``) and the ``/dev/shm`` files a process owns and must remove (``owned_files``, ``private_dir``,
``process_owner``).
"""
