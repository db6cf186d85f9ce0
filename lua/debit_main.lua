-- Applies one source region's spends for one client, at most once.
-- KEYS[1]: the client's marker for that source region and stream, holding
-- the position of the last message applied; KEYS[2..]: the client's buckets.
-- ARGV[1]: the message's stream sequence; ARGV[2]: the marker's expiry (ms);
-- ARGV[3]: the stream's epoch (its creation, µs); then four per bucket: algorithm,
-- capacity, rate (tokens/s) or window (µs), amount.
-- Messages of one source region are applied in order, so within one epoch a
-- sequence at or below the marker's was applied already: a redelivery debits
-- nothing. A stream made again starts its sequences at 1 under a later
-- epoch: a marker of an earlier epoch makes nothing a duplicate, a marker of
-- a later one (a message of a stream deleted since) makes everything one.
-- The marker is "<epoch> <seq>".
-- Replies {1, overshoot of each bucket (strings)} when applied, {0} for a
-- duplicate.
local seq = tonumber(ARGV[1])
local epoch = ARGV[3]
local marker = read_string(KEYS[1])
local last = 0
if marker then
  local e, s = string.match(marker, '^(%d+) (%d+)$')
  if e then
    e = tonumber(e)
    if e == tonumber(epoch) then
      last = tonumber(s)
    elseif e > tonumber(epoch) then
      return {0}
    end
  end
end
if seq <= last then
  return {0}
end
local now = now_us()
local tag = epoch .. '-' .. ARGV[1]
local out = {1}
for i = 2, #KEYS do
  local j = 4 + (i - 2) * 4
  local debit = debits[ARGV[j]]
  local over = 0
  if debit then
    over = debit(KEYS[i], tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3]), now, tag) or 0
  end
  out[#out + 1] = string.format('%.17g', over)
end
redis.call('SET', KEYS[1], epoch .. ' ' .. ARGV[1], 'PX', ARGV[2])
return out
