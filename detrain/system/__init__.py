"""What the operating system offers, used without trusting it: atomic writes (``tempfiles``), reads of
files another process may have planted (``file_tail``), ``/proc`` (``procfs``), download URLs (``net``), the
host report of ``detrain checks`` (``env_report``), the environment variables other programs read
(``process_env``) and where the shipped yamls are (``assets``: ``cfg/``, ``datasets/``). Any layer may import it;
it imports only ``errors``.
"""
