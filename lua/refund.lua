-- Gives back tokens leased and never handed out: KEYS[1] the bucket, ARGV
-- rate (tokens/s) and amount. Token buckets and GCRA only: their state is
-- the instant the bucket is full again, which moves back by amount / rate,
-- rounded down so a refund never returns more than was taken, and never
-- before now (a full bucket is deleted). Returns 1 when something changed.
local now = now_us()
local rate, amount = tonumber(ARGV[1]), tonumber(ARGV[2])
local full = tonumber(read_string(KEYS[1]) or 0) or 0
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
