-- Records a debit in its bucket's hold (see hold.lua for the fields): a
-- debit of amount from the source whose marker is field, last admitted at
-- seen (µs, the source's clock; 0 or nil: unknown, nothing recorded), that
-- left the bucket key d ns from full of full ns, at now. Only a bucket at
-- least a quarter spent records: the long tail's debits of full buckets
-- cost nothing more. The hash expires 2.5 s after the last record.
local function hold_record(key, field, amount, seen, d, full, now)
  if not (seen and seen > 0 and amount > 0) or d < 0.25 * full then return end
  local tau = 500000
  local hk = key .. '~h'
  local lag = math.min(math.max(now - seen, 0), 1000000)
  local received, since, mean, batch = amount, now - 100000, lag, amount
  local v = redis.call('HGET', hk, field)
  if v then
    local r, u, s, l, b = string.match(v, '^(%S+) (%S+) (%S+) (%S+) (%S+)$')
    r, u, s, l, b = tonumber(r), tonumber(u), tonumber(s), tonumber(l), tonumber(b)
    -- A source silent for 4 tau starts a new run.
    if r and u and s and l and b and now - u < 4 * tau then
      local old = r * math.exp(-math.max(now - u, 0) / tau)
      received = old + amount
      since = s
      mean = (l * old + lag * amount) / received
      batch = b + (amount - b) / 4
    end
  end
  redis.call('HSET', hk, field, string.format('%.6g %d %d %d %.6g', received, now, since, math.floor(mean), batch))
  redis.call('PEXPIRE', hk, 2500 + EXPIRY_PAD_MS)
end
