"""The prefill-gone loop (event-driven, from handlers.py): tell decode which prefills ended.

Strict KV reclaim holds an aborted request's decode KV until no write of its prefill can land.
A deleted prefill pod's IP answers nothing, so decode alone can never prove that; the kubelet
can. When a prefill pod's object goes away, `decide.confirmed_end` (pure) reads its last copy
(the watch's DELETED event): only a pod whose every container the kubelet reported terminated
is confirmed (a force-deleted pod never is). `act.record_prefill_end` folds the entry into the
resource's `<name>-prefill-gone` ConfigMap (`decide.merge_entries`: bounded, an hour of
history); decode pods mount it and release the rooms that pod can no longer write
(cas_engine.kvfence.gone_feed, cas_engine.sglang.reclaim).
"""
