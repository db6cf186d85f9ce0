-- The instant (µs) a debit is applied as of: v, at most now; now when v
-- is not a number above 0.
local function debit_at(v, now)
  local at = tonumber(v)
  if not at or at <= 0 or at > now then return now end
  return at
end

-- Applies one message of a source region to one client, at most once: the
-- part of debit_main.lua (one client) and debit_batch_main.lua (several)
-- that is theirs alike.
-- marker: the client's marker for that source region and stream, holding
-- the position of the last message applied; seq, epoch: the message's
-- stream sequence and the stream's epoch (its creation, µs), as strings;
-- ttl: the marker's expiry (ms); now: the instant (µs); n: the count of
-- the client's buckets, whose keys are keys[k..k+n-1] and whose six
-- arguments each (algorithm, capacity, rate (tokens/s) or window (µs),
-- amount, the instant (µs) as of which it is debited: see debit.lua;
-- not a number or 0 is now; and the last admission (µs, the source's
-- clock, 0 when unknown), which a bucket's or window's hold records:
-- see hold.lua) are args[a..a+6n-1]. An algorithm prefixed
-- with '!' says the
-- source region reset the key before it admitted amount: the bucket is
-- deleted (full again), then debited. The reset is applied at most once
-- with the message, by the same marker.
-- Messages of one source region are applied in order, so within one epoch a
-- sequence at or below the marker's was applied already: a redelivery debits
-- nothing. A stream made again starts its sequences at 1 under a later
-- epoch: a marker of an earlier epoch makes nothing a duplicate, a marker of
-- a later one (a message of a stream deleted since) makes everything one.
-- The marker is "<epoch> <seq>".
-- A negative amount is what a settlement there gave back: it is credited
-- (see credit in undo_lib.lua), with no overshoot.
-- When every spend of the client had refilled before it arrived (no reset,
-- no give-back, each bucket's debit would write nothing), only the buckets
-- are read, and nothing is written, the marker neither: a redelivery
-- decides the same way, unless a check here wrote the bucket since, when
-- it debits the spend once, as of its instant.
-- Returns {1, overshoot of each bucket (strings)} when applied, {0} for a
-- duplicate, {2} when every spend had refilled.
local function debit_client(marker, seq, epoch, ttl, now, n, keys, k, args, a)
  -- First whether every spend had refilled: the long tail's case, which
  -- then reads only its buckets. The states read are kept for the debits.
  local states = {}
  local quiet = true
  for i = 0, n - 1 do
    local j = a + i * 6
    local alg, amount = args[j], tonumber(args[j + 3])
    if not (amount and amount > 0) then
      quiet = false
      break
    end
    if alg == 'token_bucket' or alg == 'gcra' then
      states[i] = read_string(keys[k + i]) or false
    end
    if not debit_refilled(alg, keys[k + i], tonumber(args[j + 1]), tonumber(args[j + 2]), amount, now,
        debit_at(args[j + 4], now), states[i]) then
      quiet = false
      break
    end
  end
  if quiet then
    return {2}
  end
  local m = read_string(marker)
  local last = 0
  if m then
    local e, s = string.match(m, '^(%d+) (%d+)$')
    if e then
      e = tonumber(e)
      if e == tonumber(epoch) then
        last = tonumber(s)
      elseif e > tonumber(epoch) then
        return {0}
      end
    end
  end
  if tonumber(seq) <= last then
    return {0}
  end
  local tag = epoch .. '-' .. seq
  local out = {1}
  local wrote = false
  for i = 0, n - 1 do
    local j = a + i * 6
    local alg = args[j]
    if string.byte(alg, 1) == 33 then -- '!': reset before the amount
      redis.call('DEL', keys[k + i])
      alg = string.sub(alg, 2)
      states[i] = false
      wrote = true
    end
    local debit = debits[alg]
    local over, w = 0, true
    local amount = tonumber(args[j + 3])
    if amount and amount < 0 then
      credit(alg, keys[k + i], tonumber(args[j + 1]), tonumber(args[j + 2]), -amount, now)
    elseif debit and amount and amount > 0 then
      local d, full
      over, w, d, full = debit(keys[k + i], tonumber(args[j + 1]), tonumber(args[j + 2]), amount, now, debit_at(args[j + 4], now), tag, states[i])
      if d then hold_record(keys[k + i], marker, amount, tonumber(args[j + 5]), d, full, now) end
    end
    wrote = wrote or w
    out[#out + 1] = string.format('%.17g', over or 0)
  end
  if not wrote then
    return {2}
  end
  redis.call('SET', marker, epoch .. ' ' .. seq, 'PX', ttl)
  return out
end
