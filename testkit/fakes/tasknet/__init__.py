"""Stand-ins for TaskD's own TaskNet peers: a manager (Mgr) and workers/agents.

Each peer runs as a separate process (``python -m testkit.fakes.tasknet.peer``) with its own
environment, speaking real gRPC on real sockets, and is driven over stdin/stdout JSON lines by
``driver.PeerProcess``.  Behaviour follows TaskD's net layer as its code behaves, including where it
is unkind: exact-or-"All" rank matching (a list "0,1" matches no rank), one broadcast copy per
matching route entry, level-1 peers that drop (and, when sync, answer 5002 to) messages not for them.

Positions in JSON: ``{"role", "server_rank", "process_rank"}``.  Every stdout line is one event.
A ``send`` command carries ``{uuid, dst, body | body_size, sync, mtype}``; ``body_size`` N makes the
body "x" * N inside the peer.

Manager (``manager --listen HOST:PORT [--config JSON]``; position {Mgr,"0","-1"}):
  events   ready{port} | registered{pos,replaced} | path{uuid,proxy_pos,path} | stream{pos} |
           stream_closed{pos} | stream_refused{pos} | ack{pos,uuid,code,src} |
           received{uuid,mtype,sync,src,dst,body} | transfer_refused{uuid,dst,code} |
           routed{uuid,src,dst,code,ack_src,error[,hops,failed]} (a direct client's message routed down) |
           sent{uuid,code,ack_src,error[,hops,failed]} (broadcast: one hop per copy, duplicates kept) |
           worker_registered{name,pos} | status{name,code} | status_dropped{name,code} |
           action_sent{name,uuid,uuids,code,ack_src,error,tries[,reply_to]} | action_done{code,workers} |
           workers{workers:{name:{pos,status}}} | routes{routes} | entries{entries} |
           configured | error{error}
  commands send{...} -> sent | action{code:700|701|710|711,tries?=1,retry_interval?=3.0}
           -> action_sent per registered worker, then action_done | workers -> workers |
           routes -> routes | entries -> entries |
           config{transfer_code?,transfer_delay?,register_delay?,path_delay?,stream_delay?,
           register_reply?,register_reply_tries?} -> configured | quit
  business bodies (JSON MsgBody) of messages for the Mgr: REGISTER -> worker "Worker"+src.processRank
           at src (re-REGISTER overwrites, clears status; with register_reply, an ACTION back at once:
           action_sent{...,reply_to=REGISTER's uuid}) | STATUS -> status or status_dropped
  a down stream is installed stream_delay s after it was accepted ("stream" event); sends to its
           position before that answer 6002 "stream not inited", as TaskD's do (after a re-Register,
           6000: TaskD's entry keeps the ended stream until the new one is installed)

Worker (``worker --proxy HOST:PORT --server-rank N [--process-rank M] [--role Worker|Agent]``):
  events   ready{pos,confirmed} | rejoined{pos,confirmed} | join_failed{error} | stream_lost{error} |
           received{...} | dropped{uuid,dst,sync,reason} | dropping{joined} |
           sent{uuid,code,ack_src,error} | configured | error{error}
  commands send{...,timeout?} -> sent | drop -> dropping, then stream_lost and rejoined |
           config{auto_ack?,ack_code?,ack_delay?} -> configured | quit (stdin EOF also quits)
"""

from .driver import MGR, PeerProcess, free_port, manager, pos, worker

__all__ = ["MGR", "PeerProcess", "free_port", "manager", "pos", "worker"]
