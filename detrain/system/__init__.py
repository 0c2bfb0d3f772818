"""What the operating system offers, used without trusting it: atomic writes (``tempfiles``), reads of
files another process may have planted (``file_tail``), ``/proc`` (``procfs``), download URLs (``net``) and the
host report of ``detrain checks`` (``env_report``). Any layer may import it; it imports only ``errors``.
"""
