-- Applies one source region's spends for one client, at most once.
-- KEYS[1]: the client's marker for that source region, holding the sequence
-- of the last message applied; KEYS[2..]: the client's buckets.
-- ARGV[1]: the message's sequence; ARGV[2]: the marker's expiry (ms); then
-- four per bucket: algorithm, capacity, rate (tokens/s) or window (µs), amount.
-- Messages of one source region are applied in order, so a sequence at or
-- below the marker's was applied already: a redelivery debits nothing.
-- Replies {1, overshoot of each bucket (strings)} when applied, {0} for a
-- duplicate.
local seq = tonumber(ARGV[1])
local last = tonumber(read_string(KEYS[1]) or '0') or 0
if seq <= last then
  return {0}
end
local now = now_us()
local out = {1}
for i = 2, #KEYS do
  local j = 3 + (i - 2) * 4
  local debit = debits[ARGV[j]]
  local over = 0
  if debit then
    over = debit(KEYS[i], tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3]), now, ARGV[1]) or 0
  end
  out[#out + 1] = string.format('%.17g', over)
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return out
