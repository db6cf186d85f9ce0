-- Gives back tokens leased and never handed out: KEYS[1] the bucket; ARGV
-- algorithm, capacity, rate (tokens/s), amount. Token buckets and GCRA only:
-- their state is the instant the bucket is full again, read as a check reads
-- it (see bucket_debt in instant.lua), which moves back by the spend of amount
-- (rounded down to the ns, so a refund never returns more than was taken),
-- and never before now (a full bucket is deleted). Returns 1 when something
-- changed.
local now = now_us()
local alg, cap, rate, amount = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if alg ~= 'token_bucket' and alg ~= 'gcra' then
  return 0
end
local d, full = bucket_debt(KEYS[1], cap, rate, now)
if d <= 0 then
  return 0
end
d = d - spend_ns(amount, rate)
if d <= 0 then
  redis.call('DEL', KEYS[1])
else
  bucket_write(KEYS[1], now, d, full)
end
return 1
