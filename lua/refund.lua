-- Gives back tokens leased and never handed out: KEYS[1] the bucket; ARGV
-- algorithm, capacity, rate (tokens/s), amount. Token buckets and GCRA only:
-- their state is the instant the bucket is full again, read as a check reads
-- it (at most one capacity of debt ahead, see token_bucket_full), which moves
-- back by amount / rate, rounded down so a refund never returns more than was
-- taken, and never before now (a full bucket is deleted). Returns 1 when
-- something changed.
local now = now_us()
local alg, cap, rate, amount = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local full
if alg == 'token_bucket' then
  full = token_bucket_full(KEYS[1], cap, rate, now)
elseif alg == 'gcra' then
  full = gcra_tat(KEYS[1], cap, rate, now)
else
  return 0
end
if full <= now then
  return 0
end
full = full - math.floor(amount * 1e6 / rate)
if full <= now then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], fmt_int(full), 'PX', fmt_int(math.ceil((full - now) / 1000)))
end
return 1
