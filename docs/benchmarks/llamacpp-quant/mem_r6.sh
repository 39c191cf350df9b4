#!/bin/bash
# Issue 28, sixth run: resident memory while a 2-thread generation decodes (TOKENS, default 1500; read after WAIT s).
# ./mem_r6.sh KVSLIM_BINARY FILE.gguf  -> MiB: the GGUF mapping's Rss, AnonHugePages (the repack arena), anonymous Rss, total Rss
# Resident weights during decode: the GGUF mapping's Rss + the anonymous huge-page arena (AnonHugePages) + other anon.
BIN=$1; F=$2
$BIN generate --model $F --prompt "The quick brown fox jumps over the lazy dog and" --max-tokens ${TOKENS:-1500} --threads 2 > /dev/null 2>&1 &
pid=$!
sleep ${WAIT:-5}
python3 - $pid $F <<'PY'
import sys,re
pid,f=sys.argv[1],sys.argv[2]
cur=None; m={}
tot={'file_rss':0,'anon_huge':0,'anon_rss':0,'rss':0}
for line in open(f'/proc/{pid}/smaps'):
    if re.match(r'^[0-9a-f]+-[0-9a-f]+ ',line):
        cur=line.split()[-1] if len(line.split())>5 else ''
        continue
    k,v=line.split(':',1)
    if k=='Rss':
        kb=int(v.split()[0]); tot['rss']+=kb
        if cur.endswith('.gguf'): tot['file_rss']+=kb
        elif cur=='' or cur.startswith('['): tot['anon_rss']+=kb
    if k=='AnonHugePages': tot['anon_huge']+=int(v.split()[0])
print({k:round(v/1024,1) for k,v in tot.items()}, 'MiB')
PY
kill $pid; wait $pid 2>/dev/null
