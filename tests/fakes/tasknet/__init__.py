"""Stand-ins for TaskD's own TaskNet peers: a manager (Mgr) and workers/agents.

Each peer runs as a separate process (``python -m tests.fakes.tasknet.peer``) with its own
environment, speaking real gRPC on real sockets, and is driven over stdin/stdout JSON lines by
``driver.PeerProcess``.  Behaviour follows ``/work/shared/reference/taskd.md`` §3.

Positions in JSON: ``{"role", "server_rank", "process_rank"}``.  Every stdout line is one event.

Manager (``manager --listen HOST:PORT``; position {Mgr,"0","-1"}):
  events   ready{port} | registered{pos,replaced} | path{proxy_pos,path} | stream{pos} |
           stream_closed{pos} | stream_refused{pos} | ack{pos,uuid,code,src} |
           received{uuid,mtype,sync,src,dst,body} | transfer_refused{uuid,dst,code} |
           sent{uuid,code,ack_src,error[,hops,failed]} | routes{routes} | entries{entries} |
           configured | error{error}
  commands send{uuid,dst,body,sync,mtype} -> sent | routes -> routes | entries -> entries |
           config{transfer_code?,transfer_delay?} -> configured | quit

Worker (``worker --proxy HOST:PORT --server-rank N [--process-rank M] [--role Worker|Agent]``):
  events   ready{pos,confirmed} | rejoined{pos,confirmed} | join_failed{error} | stream_lost{error} |
           received{...} | sent{uuid,code,ack_src,error} | configured | error{error}
  commands send{uuid,dst,body,sync,mtype,timeout?} -> sent | config{auto_ack?,ack_code?,ack_delay?}
           -> configured | quit (stdin EOF also quits)
"""

from .driver import MGR, PeerProcess, free_port, manager, pos, worker

__all__ = ["MGR", "PeerProcess", "free_port", "manager", "pos", "worker"]
